"""Boundary files on NVMe, written and read by one background I/O thread.

Each engine gets its own directory `<nvme_dir>/lazytrain-<pid>-<random>`, so processes
sharing a disk never collide; files are removed as soon as their boundary is consumed,
the directory when the engine detaches (and at interpreter exit as a last resort). The
directory is made at its first use with a lock held for the process's life
(`storage/run_dirs.py`), which also removes what killed processes left there.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from lazytrain_accel.engine.device.streams import Streams, SyncStreams
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.storage.run_dirs import claim_directory


class NvmeIOError(OSError):
    """A boundary file could not be written or read: the step is abandoned before any
    optimizer update, and the engine removes its files."""


def _io_error(what: str, path: Path, err: OSError) -> NvmeIOError:
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    return NvmeIOError(
        err.errno, f"NVMe {what} of activation file {path} failed ({err.strerror or err}); "
        "this step was abandoned before the optimizer update, so weights and optimizer "
        "state are unchanged and the last checkpoint is intact. "
        + ("Free space in nvme_dir or lower nvme_limit_gb, " if full else
           "Check the drive (dmesg), ")
        + "or point nvme_dir at another local drive, then resume from the checkpoint.")


class NvmeSpill:
    def __init__(self, nvme_dir: str | None, accounting: Accounting, *,
                 streams: Streams | None = None) -> None:
        root = Path(nvme_dir) if nvme_dir else Path(tempfile.gettempdir()) / "lazytrain_nvme"
        self.directory = root / f"lazytrain-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._acct = accounting
        self._streams = streams or SyncStreams(torch.device("cpu"))  # throttles, jitters
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-nvme")
        self._sizes: dict[str, int] = {}
        self._closed = False
        self._claim_lock = threading.Lock()
        self._lock_fd: int | None = None  # held while the directory exists
        atexit.register(shutil.rmtree, self.directory, True)

    def claim(self) -> None:
        """Make the directory (once, from any thread) before a file goes in: with its
        lock held, after removing the directories of processes that died."""
        with self._claim_lock:
            if self._lock_fd is None and not self._closed:
                self._lock_fd = claim_directory(self.directory)

    def write(self, name: str, tensor: torch.Tensor) -> Future[None]:
        """Write a host tensor's bytes to file `name` in the background."""
        raw = tensor.reshape(-1).view(torch.uint8)
        self._sizes[name] = raw.numel()
        return self._io.submit(self._write, self.directory / name, raw)

    def _write(self, path: Path, raw: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            self.claim()
            with self._streams.io_link("nvme_write", raw.numel()), open(path, "wb") as f:
                f.write(raw.numpy().data)
        except OSError as err:
            path.unlink(missing_ok=True)  # no partial file outlives a failed write
            raise _io_error("write", path, err) from err
        self._acct.allocate("nvme", raw.numel())
        self._acct.add_transfer("nvme_write", time.perf_counter() - start, raw.numel())

    def read(self, name: str, out: torch.Tensor) -> Future[torch.Tensor]:
        """Fill host tensor `out` from file `name` in the background (after its write)."""
        self._streams.poison(out)  # a read of `out` before this future's result shows
        return self._io.submit(self._read, self.directory / name, out)

    def _read(self, path: Path, out: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        raw = out.reshape(-1).view(torch.uint8)
        try:
            with self._streams.io_link("nvme_read", raw.numel()), open(path, "rb") as f:
                got = f.readinto(raw.numpy().data)
        except OSError as err:
            raise _io_error("read", path, err) from err
        if got != raw.numel():
            raise OSError(f"boundary file {path} holds {got} bytes, expected {raw.numel()}: "
                          "the NVMe directory was modified while training; do not share it")
        self._acct.add_transfer("nvme_read", time.perf_counter() - start, raw.numel())
        return out

    def remove(self, name: str) -> None:
        """Delete file `name` (queued after any pending I/O on it)."""
        size = self._sizes.pop(name, None)
        if size is None:
            return
        if self._closed:  # a late garbage-collected forward: no I/O is pending any more
            self._remove(self.directory / name, size)
        else:
            self._io.submit(self._remove, self.directory / name, size)

    def _remove(self, path: Path, size: int) -> None:
        if path.exists():
            path.unlink()
            self._acct.free("nvme", size)
        # else: its write failed (and removed it) before the bytes were accounted

    def flush(self) -> None:
        """Wait for every queued write, read and removal.

        A shut-down executor has nothing queued: `close()` waited for it, and at
        interpreter exit concurrent.futures' own hook (run before `atexit`'s, so before
        `ranks.register_exit_teardown`'s wait for the engine) let its worker run every
        queued item, then joined it and marked the executor shut down."""
        try:
            done = self._io.submit(lambda: None)
        except RuntimeError:
            if not self._io._shutdown:  # not the executor's own refusal to take more
                raise
            return
        done.result()

    def close(self) -> None:
        self._closed = True
        self._io.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        with self._claim_lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
