"""Checkpoint files written past the page cache (`O_DIRECT`), through one small aligned
staging buffer: the bytes go from the tensors to the disk, not into fresh page-cache
pages first (which a VM guest pays for with the training's cores).

`O_DIRECT` wants the buffer's address, each write's length and its file offset aligned to
the device's block, so every byte goes through `Staging` (one page-aligned buffer of
`STAGING_BYTES` that a writer's files share); a file's tail past its last whole block
waits there until `finish` writes it padded and truncates the file to its length. Where
the file system refuses `O_DIRECT` (tmpfs, some FUSE) the same writes go through the page
cache. Memory: `STAGING_BYTES` per writer, whatever the checkpoint's size. Why: docs/
architecture.md "Checkpoints beside training"; figures: docs/benchmarks.md "Checkpoints".
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from pathlib import Path

import numpy as np

#: The alignment `O_DIRECT` needs on Linux block devices (a 512-byte sector device
#: accepts it too).
BLOCK_BYTES = 4096
#: Bytes per `pwrite(2)`: large enough for the disk's full speed (docs/benchmarks.md
#: "Checkpoints beside training").
STAGING_BYTES = 16 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: buffered


class Staging:
    """A page-aligned buffer of `size_bytes` (a multiple of `BLOCK_BYTES`) that the files
    of one writer take turns to fill (`DirectFile`); one thread writes them all."""

    def __init__(self, size_bytes: int = STAGING_BYTES) -> None:
        if size_bytes <= 0 or size_bytes % BLOCK_BYTES:
            raise ValueError(f"size_bytes={size_bytes} must be a positive multiple of "
                             f"{BLOCK_BYTES}")
        self._map = mmap.mmap(-1, size_bytes)  # anonymous: page-aligned, zeroed
        self.view = memoryview(self._map)
        self.address = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        self.owner: DirectFile | None = None
        self.filled_bytes = 0


class DirectFile:
    """`path` created (truncated) and written front to back through `staging`: `write`
    appends, `finish` writes what is left and sets the file's length, `fsync` and
    `close` as for any file."""

    def __init__(self, path: Path, staging: Staging) -> None:
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o666)
        except OSError as err:
            if err.errno != errno.EINVAL or not _O_DIRECT:
                raise
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._staging = staging
        self._offset_bytes = 0  # on the disk: whole blocks, the staging buffer's start
        self._tail = b""  # bytes past them, while another file holds the staging buffer

    @property
    def direct(self) -> bool:
        """Whether the writes bypass the page cache."""
        return bool(_O_DIRECT) and bool(fcntl.fcntl(self._fd, fcntl.F_GETFL) & _O_DIRECT)

    def write(self, data: memoryview | bytes) -> int:
        """Append `data` (copied into the staging buffer, which is written whenever it is
        full); returns its length. `data` may change once this returns."""
        staging = self._take_staging()
        source = np.frombuffer(data, dtype=np.uint8)
        address, size = source.ctypes.data, source.nbytes
        done = 0
        while done < size:
            take = min(len(staging.view) - staging.filled_bytes, size - done)
            # ctypes releases the GIL for the copy: the training thread runs meanwhile
            ctypes.memmove(staging.address + staging.filled_bytes, address + done, take)
            staging.filled_bytes += take
            done += take
            if staging.filled_bytes == len(staging.view):
                self._write_blocks(len(staging.view))
        return size

    def finish(self) -> None:
        """Write the bytes still staged (the last block padded with zeros) and set the
        file's length to the bytes written."""
        staging = self._take_staging()
        length = self._offset_bytes + staging.filled_bytes
        padded = -staging.filled_bytes % BLOCK_BYTES
        staging.view[staging.filled_bytes:staging.filled_bytes + padded] = bytes(padded)
        staging.filled_bytes += padded
        self._write_blocks(staging.filled_bytes)
        staging.owner = None
        os.ftruncate(self._fd, length)

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._staging.owner is self:
            self._staging.owner = None
        os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_staging(self) -> Staging:
        """The staging buffer, holding this file's tail first: the file that held it
        writes its whole blocks and keeps its own tail."""
        staging = self._staging
        if staging.owner is self:
            return staging
        if staging.owner is not None:
            staging.owner._give_staging()
        staging.view[:len(self._tail)] = self._tail
        staging.filled_bytes, self._tail = len(self._tail), b""
        staging.owner = self
        return staging

    def _give_staging(self) -> None:
        staging = self._staging
        whole_bytes = staging.filled_bytes - staging.filled_bytes % BLOCK_BYTES
        self._write_blocks(whole_bytes)
        self._tail = bytes(staging.view[:staging.filled_bytes])
        staging.owner = None

    def _write_blocks(self, size_bytes: int) -> None:
        """Write the staging buffer's first `size_bytes` (whole blocks) at the file's
        offset; what was staged past them moves to the buffer's start."""
        staging = self._staging
        done = 0
        while done < size_bytes:
            done += self._pwrite(staging.view[done:size_bytes], self._offset_bytes + done)
        self._offset_bytes += size_bytes
        rest = staging.filled_bytes - size_bytes
        staging.view[:rest] = staging.view[size_bytes:staging.filled_bytes]
        staging.filled_bytes = rest

    def _pwrite(self, data: memoryview, offset_bytes: int) -> int:
        try:
            return os.pwrite(self._fd, data, offset_bytes)
        except OSError as err:  # a file system that opened O_DIRECT but refuses its writes
            if err.errno != errno.EINVAL or not self.direct:
                raise
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            return os.pwrite(self._fd, data, offset_bytes)
