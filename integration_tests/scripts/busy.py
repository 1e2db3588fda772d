"""A machine that is not quiet: a process spinning on a core and a process writing files on
the disk of the cache, as beside a user's first launch on a shared box
(`with busy_machine(directory): ...`)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

#: Rewrites a 64 MiB file in 4 MiB chunks, fsync'd, forever: the drive's free space moves.
_WRITER = """
import os, sys
path, chunk = sys.argv[1], os.urandom(4 << 20)
while True:
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.unlink(path)
"""


@contextlib.contextmanager
def busy_machine(directory: Path) -> Iterator[None]:
    """A core spun and files written in `directory` while the block runs."""
    directory.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]),
             subprocess.Popen([sys.executable, "-c", _WRITER, str(directory / "busy.bin")])]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
