"""Two-process launches of the script a new user writes first (issue 22 item 5): every rank
exits 0 (no abort at exit), and ranks that disagree on the plan fail at `prepare`; the
first launch on a new machine (an empty cache, measured, the machine busy) trains one
plan on every rank (issue 43)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from busy import busy_machine

SCRIPT = Path(__file__).parent / "scripts" / "new_user_train.py"
ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, env: dict[str, str] | None = None, *args: str
            ) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--main_process_port", str(port), "--num_machines", "1", "--mixed_precision",
         "no", "--dynamo_backend", "no", str(SCRIPT), "--steps", "2", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), "LAZYTRAIN_HARDWARE": "h800",
             **(env or {})},
        capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_a_two_process_launch_exits_0_on_every_rank(tmp_path: Path) -> None:
    proc = _launch(tmp_path)
    # The launcher exits 0 only when every rank did (an abort at exit is exit -6).
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "rank 0: loss" in proc.stdout and "rank 1: loss" in proc.stdout
    assert "terminate called" not in proc.stderr


def test_ranks_that_disagree_on_the_plan_fail_at_prepare(tmp_path: Path) -> None:
    proc = _launch(tmp_path, env={"LAZYTRAIN_TEST_RANK1_PLAN": "checkpoint_all"})
    assert proc.returncode != 0
    assert "the ranks of this launch disagree on the plan" in proc.stderr
    assert "rank 0: loss" not in proc.stdout  # no rank trained


def test_a_first_launch_measured_on_a_busy_machine_runs_one_plan_on_every_rank(
        tmp_path: Path) -> None:
    """An empty cache and `hardware="auto"`, a core spun and the drive written beside it
    (each rank measured and planned on its own: the free bytes it fingerprinted moved
    between their reads, 0 of 5 such launches trained); rank 1 has a smaller device
    budget: rank 0 measures and plans once, for the smaller, and both run that plan."""
    with busy_machine(tmp_path / "lazytrain_nvme"):
        proc = _launch(tmp_path, {"LAZYTRAIN_HARDWARE": "auto", "LAZYTRAIN_TEST_RANK1_GPU_GB":
                                  "0.5"}, "--plan", "auto", "--verbose")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    plans = dict(re.findall(r"rank (\d) runs plan (\w+)", proc.stderr))
    assert set(plans) == {"0", "1"} and len(set(plans.values())) == 1, proc.stderr[-6000:]
    assert ("the ranks' budgets differ (device: rank 0 " in proc.stderr
            and "rank 1 0.50 GiB); every rank plans for the least: device 0.50 GiB"
            in proc.stderr), proc.stderr[-6000:]
    cache = tmp_path / "lazytrain_cache"
    assert len(list(cache.glob("hardware-*.json"))) == 1  # measured once
