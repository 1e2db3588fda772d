"""Two-process launches in a row: how many exit 0 on every rank (issue 22 item 5).

Each launch is `accelerate launch --multi_gpu --num_processes 2` (accelerate's
multi-process CPU mode) of `integration_tests/scripts/new_user_train.py`, the script a new
user writes first: `Accelerator(cpu=True)` with the plugin, two steps, nothing at the end.
A rank that dies at exit (SIGABRT, "terminate called without an active exception") fails
its launch. Prints one line per launch and the count:

    python bench/launch_loop.py [--launches 20] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "integration_tests" / "scripts" / "new_user_train.py"
LAUNCH_TIMEOUT_S = 600
#: Lines of a failed launch's output that say why (the abort, a rank's exit code).
TELLING = ("terminate called", "SIGABRT", "exitcode", "Error", "error")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir: Path, *, processes: int, steps: int,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One `accelerate launch` of the new-user script; the launcher exits 0 only when
    every rank did."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", str(processes), "--main_process_port", str(free_port()),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(SCRIPT), "--steps", str(steps)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "LAZYTRAIN_HARDWARE": "h800",
                "LAZYTRAIN_CACHE_DIR": str(workdir / "cache"),
                "LAZYTRAIN_NVME_DIR": str(workdir / "nvme"), **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S, cwd=workdir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    clean = 0
    with tempfile.TemporaryDirectory(prefix="lazytrain-launch-loop-") as tmp:
        for k in range(1, args.launches + 1):
            start = time.perf_counter()
            proc = launch(Path(tmp), processes=args.processes, steps=args.steps)
            clean += proc.returncode == 0
            print(f"launch {k}: exit {proc.returncode} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            if proc.returncode != 0:
                output = (proc.stdout + proc.stderr).splitlines()
                telling = [line for line in output if any(t in line for t in TELLING)]
                print("\n".join(f"    {line}" for line in telling[-12:]), flush=True)
    print(f"{clean}/{args.launches} launches exited 0 on every rank")


if __name__ == "__main__":
    main()
