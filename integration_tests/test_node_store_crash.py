"""Nothing of the node store outlives a job killed for real (issue 30): SIGKILL to the
launcher and to every worker's session, as a scheduler or the OOM killer does, during the
fill, mid-step and during a checkpoint save. Afterwards no process maps the job's segment,
nothing of it is under /dev/shm, and `Shmem` (/proc/meminfo) is back within 64 MiB of its
level before the launch.

Cost: the fill is killed 5 times in a job that only builds the store (a launcher and two
ranks forked from one process that imported torch once, `scripts/store_fill.py`: 128 MiB
reserved, its fill slowed on purpose); mid-step
and during a save, one full `accelerate launch` each (85 MB store), as full launches cost
~20 s of two cores each.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integration_tests.test_accelerate_launch import launch_command
from lazytrain_accel.distributed import node_store

SCRIPTS = Path(__file__).parent / "scripts"
SHMEM_SLACK_BYTES = 64 * 2**20
#: Killed processes release their pages within this (the kernel tears their memory down).
SETTLE_S = 20.0
#: A model whose store (~85 MB of fp32 masters) shows in `Shmem` if it leaks.
FULL_ARGS = ("--lazytrain", "--plan", "checkpoint_all", "--optimizer", "keep",
             "--hidden-size", "768", "--batch-size", "4")


def _shmem_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def _store_mappings() -> set[tuple[int, str]]:
    """(pid, segment name) of every process on this host mapping a node store segment
    (/memfd:NAME, or a file NAME, deleted or not)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "lazytrain-" in line:
                    path = line.split(None, 5)[5]
                    found.add((int(pid), path.rpartition("/")[2].split()[0].split(":")[-1]))
    return found


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "lazytrain" in n}


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                out += children
                todo += children
    return out


def _kill_job(pid: int) -> list[int]:
    """SIGKILL the launcher `pid` and every process under it, each worker's session too
    (torch's launcher starts each in a session of its own); the pids killed."""
    pids = [pid, *_descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(p), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return pids


def _wait_for(ready: Callable[[], bool], job: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        if job.poll() is not None:
            raise AssertionError(f"the job ended ({job.returncode}) before {what}: "
                                 f"{job.communicate()[0][-4000:]}")
        assert time.monotonic() < deadline, f"no {what} within 300 s"
        time.sleep(0.05)


class _Baseline:
    """What is there before a launch; `assert_restored` after killing it."""

    def __init__(self) -> None:
        self.mappings, self.shm = _store_mappings(), _shm_entries()
        self.shmem_bytes = _shmem_bytes()

    def assert_restored(self, killed: list[int]) -> None:
        deadline = time.monotonic() + SETTLE_S
        while True:
            alive = [p for p in killed if node_store.pid_alive(p)]
            left = _store_mappings() - self.mappings
            grown = _shmem_bytes() - self.shmem_bytes
            if not alive and not left and grown <= SHMEM_SLACK_BYTES:
                break
            assert time.monotonic() < deadline, (
                f"{SETTLE_S} s after the kill: alive {alive}, segments still mapped {left}, "
                f"Shmem {grown / 2**20:+.0f} MiB over its baseline")
            time.sleep(0.2)
        assert _shm_entries() <= self.shm


@pytest.fixture(scope="module")
def fill_jobs() -> Iterator[subprocess.Popen]:
    """`scripts/store_fill.py`: it imports torch once and forks a job per line."""
    forker = subprocess.Popen([sys.executable, str(SCRIPTS / "store_fill.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    yield forker
    forker.stdin.close()
    forker.wait(timeout=60)


@pytest.mark.parametrize("attempt", range(5))
def test_a_job_killed_during_the_fill_leaves_nothing(fill_jobs: subprocess.Popen,
                                                     tmp_path: Path, attempt: int) -> None:
    """The leader has reserved 128 MiB (in `Shmem` from then on) and is copying into it
    when the whole job is killed."""
    filling = tmp_path / "filling"
    name = node_store.segment_name(job_id=str(tmp_path), node_id=f"fill-{attempt}")
    baseline = _Baseline()
    fill_jobs.stdin.write(f"{name} {filling}\n")
    fill_jobs.stdin.flush()
    launcher = int(fill_jobs.stdout.readline())
    _wait_for(filling.exists, fill_jobs, "the fill")
    assert any(seg == name for _, seg in _store_mappings())  # killed inside the fill
    assert _shmem_bytes() - baseline.shmem_bytes > SHMEM_SLACK_BYTES  # the check can fail
    baseline.assert_restored(_kill_job(launcher))


@pytest.mark.parametrize("point", ["mid-step", "save"])
def test_a_training_job_killed_leaves_nothing(tmp_path: Path, point: str) -> None:
    """Two ranks of `accelerate launch` with the node store, killed whole after their
    first steps (mid-step: the steps are the run's time) or inside `save_state`."""
    losses, progress = tmp_path / "losses.json", tmp_path / "progress"
    args = ("--losses", str(losses), *FULL_ARGS, "--steps", "500", "--progress-out",
            str(progress))
    if point == "save":
        args += ("--save-at", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--slow-save-s",
                 "300")
    argv, env = launch_command(tmp_path, *args, num_processes=2)
    baseline = _Baseline()
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if point == "save":
        _wait_for(Path(f"{losses}.saving").exists, launcher, "the save")
    else:
        _wait_for(lambda: progress.exists() and progress.read_text() >= "2", launcher,
                  "step 2")
    assert _store_mappings() - baseline.mappings  # the store is there to leak
    killed = _kill_job(launcher.pid)
    launcher.wait(timeout=60)
    baseline.assert_restored(killed)
