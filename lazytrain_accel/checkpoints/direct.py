"""Checkpoint files written past the page cache (`O_DIRECT`), through one small aligned
staging buffer: the bytes go from the tensors to the disk, not into fresh page-cache
pages first (which a VM guest pays for with the training's cores).

`O_DIRECT` wants the buffer's address, each write's length and its file offset aligned to
the device's block, so every byte goes through `Staging` (one page-aligned buffer of
`STAGING_BYTES` that a writer's files share); a file's tail past its last whole block
waits there until `finish` writes it padded and truncates the file to its length. Where
the file system refuses `O_DIRECT` (tmpfs, some FUSE) the same writes go through the page
cache. `copy_from` appends a range of another file file to file (`copy_file_range(2)`).
Primitives: `storage/direct_io.py`. Memory: `STAGING_BYTES` per writer, whatever the
checkpoint's size. Why: docs/architecture.md "Checkpoints beside training"; figures:
docs/benchmarks.md "Checkpoints".
"""

from __future__ import annotations

import ctypes
import errno
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
        self._path = path
        self._fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._copy_fd: int | None = None  # the same file without O_DIRECT: `copy_from`
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

    def copy_from(self, source: int, offset_bytes: int, nbytes: int) -> int:
        """Append `nbytes` of the file open as `source` from `offset_bytes`, file to file:
        the whole blocks between this file's next block boundary and the last one by the
        kernel (`copy_file_range(2)`; `sendfile(2)` where the two file systems refuse it),
        never through this process; the bytes before and after them (under a block each)
        through the staging buffer. Returns `nbytes`."""
        staging = self._take_staging()
        head = min(-(self._offset_bytes + staging.filled_bytes) % BLOCK_BYTES, nbytes)
        whole = (nbytes - head) // BLOCK_BYTES * BLOCK_BYTES
        self.write(_pread(source, head, offset_bytes))
        if whole:
            self._write_blocks(self._take_staging().filled_bytes)  # whole blocks: all
            if self._copy_fd is None:
                self._copy_fd = os.open(self._path, os.O_WRONLY)
            copy_range(source, offset_bytes + head, self._copy_fd, self._offset_bytes, whole)
            self._offset_bytes += whole
        self.write(_pread(source, nbytes - head - whole, offset_bytes + head + whole))
        return nbytes

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
        if self._copy_fd is not None:
            os.close(self._copy_fd)
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


def _pread(fd: int, nbytes: int, offset_bytes: int) -> bytes:
    data = os.pread(fd, nbytes, offset_bytes) if nbytes else b""
    if len(data) != nbytes:
        raise OSError(errno.EIO, f"read {len(data)} of {nbytes} bytes at {offset_bytes}: "
                                 "the source file is shorter than the range to copy")
    return data


def copy_range(source: int, source_offset_bytes: int, target: int, target_offset_bytes: int,
               nbytes: int) -> None:
    """Copy `nbytes` from `source` at `source_offset_bytes` to `target` at
    `target_offset_bytes` inside the kernel: `copy_file_range(2)` (a reflink where the
    file system shares blocks), else `sendfile(2)` where the two files' file systems
    refuse it (EXDEV across some mounts, EINVAL, EOPNOTSUPP, ENOSYS)."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(source, target, nbytes - done, source_offset_bytes + done,
                                   target_offset_bytes + done)
            if n == 0:
                raise OSError(errno.EIO, f"copied {done} of {nbytes} bytes: the source "
                                         "file is shorter than the range to copy")
            done += n
        return
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    os.lseek(target, target_offset_bytes + done, os.SEEK_SET)
    while done < nbytes:
        n = os.sendfile(target, source, source_offset_bytes + done, nbytes - done)
        if n == 0:
            raise OSError(errno.EIO, f"copied {done} of {nbytes} bytes: the source file "
                                     "is shorter than the range to copy")
        done += n
