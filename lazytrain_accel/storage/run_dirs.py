"""A process's own directory under a shared root (`nvme_dir`) that a killed process does
not leave behind for good.

`claim_directory` makes it under a temporary name with a lock file inside, locked
(`flock`) for as long as the process lives, then renames it into place, so every
directory of that name has a held lock from its first moment. Before that it removes
each sibling whose lock nobody holds: the kernel drops a lock when its process dies, even
by kill -9, so the next run on the drive finds it as a clean exit leaves it. A lock, not a
PID test: two containers sharing a drive see different PIDs, and a PID is reused.
Used by `engine/memory/nvme.py` (the boundary and state files).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from pathlib import Path

#: The lock file inside each claimed directory.
LOCK_NAME = ".owner.lock"
#: A temporary directory without its lock file yet is a claim in progress, or one killed
#: in the microseconds before its lock was taken: removed once this old.
UNLOCKED_TEMP_AGE_S = 600.0


def _temp_name(name: str) -> str:
    return f".{name}.tmp"


def claim_directory(path: Path) -> int:
    """Make `path` (a name unique to this process) with its lock held; return the lock's
    file descriptor, to be closed after the directory is removed. Siblings of the same
    prefix (the name up to its first "-") whose owner died are removed first."""
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    sweep_dead(root, prefix=path.name.split("-", 1)[0] + "-")
    temp = root / _temp_name(path.name)
    temp.mkdir()
    fd = os.open(temp / LOCK_NAME, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temp, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return fd


def sweep_dead(root: Path, *, prefix: str) -> list[Path]:
    """Remove the directories under `root` named `prefix*` (and their temporary names)
    whose lock no process holds; return them. A directory without a lock file (one not
    made by `claim_directory`) is left alone, but a temporary one older than
    `UNLOCKED_TEMP_AGE_S`."""
    removed = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        temp = name.startswith(".") and name.endswith(".tmp")
        if not (name.startswith(prefix) or (temp and name[1:].startswith(prefix))):
            continue
        if _remove_if_dead(entry, temp=temp):
            removed.append(entry)
    return removed


def _remove_if_dead(directory: Path, *, temp: bool) -> bool:
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if not temp:
            return False
        try:
            old = time.time() - directory.stat().st_mtime > UNLOCKED_TEMP_AGE_S
        except FileNotFoundError:
            return False
        if old:
            shutil.rmtree(directory, ignore_errors=True)
        return old
    except (NotADirectoryError, PermissionError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False  # its owner lives
        raise
    try:  # ours now: its owner is gone
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(fd)
    return True
