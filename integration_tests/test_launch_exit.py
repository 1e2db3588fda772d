"""Two-process launches of the script a new user writes first (issue 22 item 5): every rank
exits 0 (no abort at exit), and ranks that disagree on the plan fail at `prepare`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "new_user_train.py"
ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--main_process_port", str(port), "--num_machines", "1", "--mixed_precision",
         "no", "--dynamo_backend", "no", str(SCRIPT), "--steps", "2"],
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
