"""kill -9 while the layers' state streams to and from NVMe (issue 44): five lives of one
run, each killed at a random moment of its steps (copies, gradients, masters and moments
written and read, a checkpoint being saved), each resumed by the next from the last
checkpoint; the run ends with the losses and weights of a run never killed, bit for bit,
and nothing left in `nvme_dir`: each kill left its engine's directory, and the next
engine's claim removed it (`storage/run_dirs.py`). The lives are forks of one
`subprocess` child that imported once (nvme_state_child.py)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

KILLS = 5
STEPS = 24
#: A life is killed this long after its first checkpoint, at random: within its next
#: steps (each ~0.1-0.3 s here), so it dies among their state writes.
KILL_WINDOW_S = 0.4


def _losses(directory: Path) -> dict[int, str]:
    """Each step's loss as its last life logged it (a killed life may have logged a step
    its checkpoint did not keep: the next one ran it again)."""
    out: dict[int, str] = {}
    logs = sorted(directory.glob("losses-*"), key=lambda p: p.stat().st_mtime)
    for log in logs:
        for line in log.read_text().splitlines():
            step, loss = line.split()
            out[int(step)] = loss
    return out


def test_five_kills_during_the_state_io_resume_exactly_and_leave_no_files(
        tmp_path: Path) -> None:
    seed = int(time.time())
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "nvme_state_child.py"), str(tmp_path),
         str(KILLS + 1), str(STEPS)], stdout=subprocess.PIPE, env=env, text=True,
        start_new_session=True)
    ended: list[int] = []
    killed = 0
    try:
        timer = None
        for line in child.stdout:
            word, *rest = line.split()
            if word == "saved" and killed < KILLS and timer is None:
                pid = int(rest[0])
                timer = threading.Timer(rng.uniform(0.0, KILL_WINDOW_S), os.kill,
                                        (pid, signal.SIGKILL))
                timer.start()
            elif word == "ended":
                ended.append(int(rest[0]))
                if timer is not None:
                    timer.join()
                    killed += 1
                    timer = None
        child.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert ended[:KILLS] == [-signal.SIGKILL] * KILLS, (seed, ended)
    assert ended[KILLS:] == [0, 0], (seed, ended)  # the last life, the reference
    reference = tmp_path / "reference"
    assert sorted(_losses(tmp_path)) == list(range(STEPS))
    assert _losses(tmp_path) == _losses(reference), seed
    weights, expected = torch.load(tmp_path / "final.pt"), torch.load(reference / "final.pt")
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    assert list((tmp_path / "nvme").iterdir()) == [], seed
