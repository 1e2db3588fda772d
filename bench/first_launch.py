"""A user's first multi-process launch on a new machine, many times (issue 43): each launch
has an empty cache directory and `hardware="auto"`, with a process spinning on a core and
another writing files on the cache's disk beside it. Counts the launches that trained
(exit 0 on every rank) and logged one plan fingerprint on every rank.

    PYTHONPATH=. python bench/first_launch.py [--accelerate 10] [--trainer 5] [--nodes 3]

Kinds: two-process `accelerate launch` of the script a new user writes first
(integration_tests/scripts/new_user_train.py, `plan="auto"`); two-process Trainer runs
of a stock script through `-m lazytrain_accel.launch --lazytrain`; two simulated nodes x
two ranks (one `accelerate launch` per node, static rendezvous on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "integration_tests" / "scripts"))
from busy import busy_machine  # noqa: E402

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
COMMON = ["--mixed_precision", "no", "--dynamo_backend", "no"]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _commands(kind: str, work: Path) -> list[list[str]]:
    """The launcher command lines of one launch of `kind` (one per simulated node)."""
    two = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", _port(),
           "--num_machines", "1", *COMMON]
    if kind == "accelerate":
        return [[*two, str(ROOT / "integration_tests/scripts/new_user_train.py"), "--plan",
                 "auto", "--verbose", "--steps", "2"]]
    if kind == "trainer":
        return [[*two, "-m", "lazytrain_accel.launch",
                 str(ROOT / "integration_tests/trainer_scripts/stock_trainer.py"),
                 "--lazytrain", "--summary", str(work / "summary.json"), "--output_dir",
                 str(work / "out"), "--per_device_train_batch_size", "4", "--max_steps", "2",
                 "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                 "--use_cpu", "--log_level", "info", "--log_level_replica", "info"]]
    port = _port()
    return [[*ACCELERATE, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(r),
             "--num_processes", "4", "--main_process_ip", "127.0.0.1", "--main_process_port",
             port, *COMMON, str(ROOT / "integration_tests/scripts/accelerate_train.py"),
             "--cpu", "--lazytrain", "--verbose", "--steps", "2", "--losses",
             str(work / "losses.json")] for r in range(2)]


def launch(kind: str, work: Path, ranks: int) -> tuple[bool, str]:
    """One launch: (trained with one plan on all `ranks`, what it says)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAZYTRAIN_HARDWARE": "auto",
           "LAZYTRAIN_CACHE_DIR": str(work / "cache"), "LAZYTRAIN_NVME_DIR": str(work / "nvme")}
    with busy_machine(work / "busy"):
        procs = [subprocess.Popen(c, env=env, cwd=work, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for c in _commands(kind, work)]
        outputs = [p.communicate(timeout=900)[0] for p in procs]
    text = "\n".join(outputs)
    plans = dict(re.findall(r"rank (\d+) runs plan (\w+)", text))
    failed = [p.returncode for p in procs if p.returncode != 0]
    if failed:
        error = [line for line in text.splitlines() if "Error" in line][-1:]
        return False, f"exit {failed}: {error}"
    if len(plans) != ranks or len(set(plans.values())) != 1:
        return False, f"plans {plans}"
    return True, f"plan {next(iter(plans.values()))} on ranks {sorted(plans)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerate", type=int, default=10)
    parser.add_argument("--trainer", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    for kind, count, ranks in (("accelerate", args.accelerate, 2),
                               ("trainer", args.trainer, 2), ("nodes", args.nodes, 4)):
        trained = 0
        for i in range(count):
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="lazytrain-first-") as work:
                ok, said = launch(kind, Path(work), ranks)
            trained += ok
            print(f"{kind} {i + 1}/{count}: {'trained' if ok else 'FAILED'} in "
                  f"{time.perf_counter() - start:.0f} s, {said}", flush=True)
        print(f"{kind}: {trained} of {count} launches trained with one plan on every rank",
              flush=True)


if __name__ == "__main__":
    main()
