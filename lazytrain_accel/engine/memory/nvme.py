"""Boundary files on NVMe, written and read by a background I/O thread per drive.

Each engine gets its own directory `<nvme_dir>/lazytrain-<pid>-<random>` on each drive
`nvme_dir` names (`storage/drives.py`: boundary `j`'s file on drive `j % D`), so processes
sharing a disk never collide; files are removed as soon as their boundary is consumed,
the directories when the engine detaches (and at interpreter exit as a last resort). They
are made at their first use with a lock held for the process's life
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
from lazytrain_accel.storage.drives import drive_of, split_dirs
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
        roots = (split_dirs(nvme_dir) if nvme_dir
                 else [Path(tempfile.gettempdir()) / "lazytrain_nvme"])
        name = f"lazytrain-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        #: this engine's directory on each drive, in `nvme_dir`'s order
        self.directories = [root / name for root in roots]
        self._acct = accounting
        self._streams = streams or SyncStreams(torch.device("cpu"))  # throttles, jitters
        # one thread per drive: a file's write, read and removal keep their order on it
        self._io = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lazytrain-nvme{d}")
                    for d in range(len(roots))]
        self._sizes: dict[str, int] = {}
        self._closed = False
        self._claim_lock = threading.Lock()
        self._lock_fds: list[int] = []  # held while the directories exist
        for directory in self.directories:
            atexit.register(shutil.rmtree, directory, True)

    @property
    def state_dirs(self) -> list[Path]:
        """Where the host state's files go, one directory per drive (`LayerFiles`)."""
        return [directory / "state" for directory in self.directories]

    def claim(self) -> None:
        """Make the directories (once, from any thread) before a file goes in: each with
        its lock held, after removing the directories of processes that died."""
        with self._claim_lock:
            if not self._lock_fds and not self._closed:
                for directory in self.directories:
                    self._lock_fds.append(claim_directory(directory))

    def _drive(self, index: int) -> int:
        return drive_of(index, len(self.directories))

    def write(self, name: str, tensor: torch.Tensor, *, index: int = 0) -> Future[None]:
        """Write a host tensor's bytes to file `name` in the background, on the drive of
        boundary `index` (its reads and removal name the same index)."""
        raw = tensor.reshape(-1).view(torch.uint8)
        self._sizes[name] = raw.numel()
        drive = self._drive(index)
        return self._io[drive].submit(self._write, self.directories[drive] / name, raw)

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

    def read(self, name: str, out: torch.Tensor, *, index: int = 0) -> Future[torch.Tensor]:
        """Fill host tensor `out` from file `name` in the background (after its write)."""
        self._streams.poison(out)  # a read of `out` before this future's result shows
        drive = self._drive(index)
        return self._io[drive].submit(self._read, self.directories[drive] / name, out)

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

    def remove(self, name: str, *, index: int = 0) -> None:
        """Delete file `name` (queued after any pending I/O on it)."""
        size = self._sizes.pop(name, None)
        if size is None:
            return
        drive = self._drive(index)
        path = self.directories[drive] / name
        if self._closed:  # a late garbage-collected forward: no I/O is pending any more
            self._remove(path, size)
        else:
            self._io[drive].submit(self._remove, path, size)

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
        for io in self._io:
            try:
                done = io.submit(lambda: None)
            except RuntimeError:
                if not io._shutdown:  # not the executor's own refusal to take more
                    raise
                continue
            done.result()

    def close(self) -> None:
        self._closed = True
        for io in self._io:
            io.shutdown(wait=True)
        for directory in self.directories:
            shutil.rmtree(directory, ignore_errors=True)
        with self._claim_lock:
            for fd in self._lock_fds:
                os.close(fd)
            self._lock_fds = []
