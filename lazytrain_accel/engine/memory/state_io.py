"""`StateIO`: the one direct-I/O of an engine's host-state files (the compute copies of
`copy_files.py`, the gradients of `grad_files.py`, the masters of `optimizer_files.py`),
so the requests of every part share one queue of `STATE_IO_WORKERS` threads per drive, and
each direction's time is the drives' busy time (the union of their requests' spans): bytes
over it is the rate the drives gave, which summing each request's own seconds would
understate whenever they overlap.
Docs: docs/engine.md "Host state on NVMe".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.storage.direct_io import DirectIO

#: Two threads, so two requests in flight: one alone reached half the drive's `O_DIRECT`
#: rate here (bench/nvme_state.py); they sleep in the kernel while they wait.
STATE_IO_WORKERS = 2
READ, WRITE = "state_nvme_read", "state_nvme_write"
#: Either direction: where a drive cannot read and write at once, the rate it gave is the
#: bytes of both over the time it was busy with either (`HardwareProfile.nvme_full_duplex`).
EITHER = "state_nvme"


class StateIO:
    """Reads and writes of state files, counted in `accounting` as `READ` / `WRITE`."""

    def __init__(self, accounting: Accounting, *,
                 pace: Callable[[str, int], AbstractContextManager[None]] | None = None
                 ) -> None:
        self._acct = accounting
        self._pace = pace  # each chunk on its link: an emulated drive's throttle
        self._io: dict[int, DirectIO] = {}  # per drive; threads start with its first request
        self._lock = threading.Lock()
        self._in_flight = {READ: 0, WRITE: 0, EITHER: 0}
        self._since = {READ: 0.0, WRITE: 0.0, EITHER: 0.0}  # the last event while busy

    def write(self, path: Path, tensors: Sequence[torch.Tensor], *, drive: int = 0
              ) -> Future[None]:
        """Write `tensors` back to back into `path` (on drive number `drive` of the run's
        `nvme_dir`); they must not change until done."""
        return self._start(WRITE, path, tensors, drive)

    def read(self, path: Path, tensors: Sequence[torch.Tensor], *, drive: int = 0
             ) -> Future[None]:
        """Fill `tensors` from `path` (written by `write` for tensors of their sizes)."""
        return self._start(READ, path, tensors, drive)

    def close(self) -> None:
        """Finish the queued requests, then end the threads."""
        ios, self._io = self._io, {}
        for io in ios.values():
            io.close()

    def _start(self, kind: str, path: Path, tensors: Sequence[torch.Tensor],
               drive: int) -> Future[None]:
        io = self._io.get(drive)
        if io is None:
            io = self._io[drive] = DirectIO(workers=STATE_IO_WORKERS, pace=self._pace)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._event(kind, +1, 0)
        start = io.write_tensors if kind == WRITE else io.read_tensors
        request = start(path, tensors)
        request.add_done_callback(lambda done: self._event(
            kind, -1, nbytes if done.exception() is None else 0))
        return request

    def _event(self, kind: str, change: int, nbytes: int) -> None:
        """A request of `kind` starts (+1) or ends (-1): the busy seconds since the last
        event of that direction, and of either (`EITHER`), are counted, with the bytes of
        one that ended whole."""
        busy_s = {}
        with self._lock:
            now = time.perf_counter()
            for counted in (kind, EITHER):
                busy_s[counted] = now - self._since[counted] if self._in_flight[counted] \
                    else 0.0
                self._in_flight[counted] += change
                self._since[counted] = now
        for counted, seconds in busy_s.items():
            self._acct.add_transfer(counted, seconds, nbytes)
