"""A process's own directory under a shared root (`storage/run_dirs.py`, issue 44): made
with its lock held; what a process killed with SIGKILL left is removed by the next claim,
what a live one holds (in this process or another) never is. The processes here are
`subprocess` children holding a claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lazytrain_accel.storage import run_dirs
from lazytrain_accel.storage.run_dirs import LOCK_NAME, claim_directory, sweep_dead

#: A child that claims `argv[1]`, writes a file into it, says so and waits to be killed.
_HOLDER = """
import sys, time
from pathlib import Path
from lazytrain_accel.storage.run_dirs import claim_directory
claim_directory(Path(sys.argv[1]))
(Path(sys.argv[1]) / "state.bin").write_bytes(b"x" * 4096)
print("claimed", flush=True)
time.sleep(600)
"""


def _holder(path: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "claimed"
    return child


def test_a_claimed_directory_holds_its_lock_from_its_first_moment(tmp_path: Path) -> None:
    path = tmp_path / "lazytrain-1-a"
    fd = claim_directory(path)
    try:
        assert (path / LOCK_NAME).is_file()
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        other = claim_directory(tmp_path / "lazytrain-1-b")  # a second engine here
        assert path.is_dir() and sweep_dead(tmp_path, prefix="lazytrain-") == []
        os.close(other)
    finally:
        os.close(fd)


def test_what_a_killed_process_left_is_removed_by_the_next_claim(tmp_path: Path) -> None:
    dead, live = tmp_path / "lazytrain-11-dead", tmp_path / "lazytrain-12-live"
    killed, running = _holder(dead), _holder(live)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (dead / "state.bin").is_file()  # what the kill left
        new = tmp_path / "lazytrain-13-new"
        fd = claim_directory(new)
        assert not dead.exists()
        os.close(fd)  # as this process's end would
        assert (live / "state.bin").is_file()  # its owner runs
    finally:
        running.kill()
        running.wait()
    assert sorted(sweep_dead(tmp_path, prefix="lazytrain-")) == [live, new]


def test_directories_it_did_not_make_are_left_alone(tmp_path: Path, monkeypatch) -> None:
    """A directory without a lock file is not ours to judge; a temporary one without its
    lock yet is a claim in progress until it is old."""
    (tmp_path / "lazytrain-old-version").mkdir()
    (tmp_path / "other-tool-dir").mkdir()
    temp = tmp_path / ".lazytrain-21-x.tmp"
    temp.mkdir()
    assert sweep_dead(tmp_path, prefix="lazytrain-") == []
    old = time.time() - run_dirs.UNLOCKED_TEMP_AGE_S - 1
    os.utime(temp, (old, old))
    assert sweep_dead(tmp_path, prefix="lazytrain-") == [temp]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lazytrain-old-version",
                                                          "other-tool-dir"]
