"""Checkpoint files written past the page cache (`O_DIRECT`), through one small aligned
staging buffer: the bytes go from the tensors to the disk, not into fresh page-cache
pages first (which a VM guest pays for with the training's cores).

`O_DIRECT` wants the buffer's address, each write's length and its file offset aligned to
the device's block, so every byte goes through `Staging` (one page-aligned buffer of
`STAGING_BYTES` that a writer's files share); a file's tail past its last whole block
waits there until `finish` writes it padded and truncates the file to its length. Where
the file system refuses `O_DIRECT` (tmpfs, some FUSE) the same writes go through the page
cache. The primitives (aligned buffers, the `O_DIRECT` open and its fallbacks) are
`storage/direct_io.py`'s. Memory: `STAGING_BYTES` per writer, whatever the checkpoint's
size. Why: docs/architecture.md "Checkpoints beside training"; figures: docs/
benchmarks.md "Checkpoints".
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from lazytrain_accel.storage.direct_io import (
    BLOCK_BYTES,
    AlignedBuffer,
    is_direct,
    open_direct,
    write_all,
)

#: Bytes per `pwrite(2)`: large enough for the disk's full speed (docs/benchmarks.md
#: "Checkpoints beside training").
STAGING_BYTES = 16 << 20


class Staging(AlignedBuffer):
    """A page-aligned buffer of `size_bytes` (a multiple of `BLOCK_BYTES`) that the files
    of one writer take turns to fill (`DirectFile`); one thread writes them all."""

    def __init__(self, size_bytes: int = STAGING_BYTES) -> None:
        super().__init__(size_bytes)
        self.owner: DirectFile | None = None
        self.filled_bytes = 0


class DirectFile:
    """`path` created (truncated) and written front to back through `staging`: `write`
    appends, `finish` writes what is left and sets the file's length, `fsync` and
    `close` as for any file."""

    def __init__(self, path: Path, staging: Staging) -> None:
        self._fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._staging = staging
        self._offset_bytes = 0  # on the disk: whole blocks, the staging buffer's start
        self._tail = b""  # bytes past them, while another file holds the staging buffer

    @property
    def direct(self) -> bool:
        """Whether the writes bypass the page cache."""
        return is_direct(self._fd)

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
        write_all(self._fd, staging.view[:size_bytes], self._offset_bytes)
        self._offset_bytes += size_bytes
        rest = staging.filled_bytes - size_bytes
        staging.view[:rest] = staging.view[size_bytes:staging.filled_bytes]
        staging.filled_bytes = rest
