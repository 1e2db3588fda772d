"""Activation store: executes the plan's home and transfer decisions for one forward pass.

Boundary i (the input of the layer at executed position i+1) is put here during the
forward. Its home decides what happens next: GPU keeps a detached device reference; CPU
offloads it to host memory; NVMe offloads it to host and on to a file, freeing the host
copy once written; RECOMPUTE keeps nothing. Each transfer stage runs in the first window
the plan assigns bytes of that stage to; a stage the plan left unscheduled, or one whose
predecessor is not done yet, runs when it is needed (the reload at the backward).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from lazytrain_accel.engine.device.streams import Event, Streams
from lazytrain_accel.engine.memory.nvme import NvmeSpill
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.planning.plan import Home, Plan, TransferKind

_FORWARD_IDS = itertools.count()


class BoundaryModifiedError(RuntimeError):
    """A boundary the engine stored for the backward was modified in place afterwards."""


@dataclass(kw_only=True)
class _Boundary:
    index: int
    home: Home
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    version: int
    device: torch.Tensor | None = None
    host: torch.Tensor | None = None
    host_ready: Event | None = None
    device_ready: Event | None = None
    write: Future[None] | None = None
    read: Future[torch.Tensor] | None = None
    on_nvme: bool = False


class ActivationStore:
    def __init__(self, plan: Plan, *, streams: Streams, spill: NvmeSpill,
                 accounting: Accounting) -> None:
        self._plan = plan
        self._streams = streams
        self._spill = spill
        self._acct = accounting
        self._tag = f"f{next(_FORWARD_IDS)}"
        self._records: dict[int, _Boundary] = {}
        self._unchecked_writes: list[Future[None]] = []  # of boundaries already released
        self._done_windows: set[int] = set()
        self._by_window: dict[int, list[tuple[int, TransferKind]]] = {}
        scheduled: set[tuple[int, TransferKind]] = set()
        for t in sorted(plan.transfers, key=lambda t: t.window):
            # a stage runs once, in the first window holding any of its bytes
            if (t.boundary, t.kind) not in scheduled:
                scheduled.add((t.boundary, t.kind))
                self._by_window.setdefault(t.window, []).append((t.boundary, t.kind))

    # ---- forward -------------------------------------------------------------------
    def put(self, index: int, tensor: torch.Tensor, *, home: Home | None = None) -> None:
        """Store boundary `index` per its plan home (or `home`, overriding the plan)."""
        home = home or self._plan.homes[index]
        rec = _Boundary(index=index, home=home, nbytes=tensor.numel() * tensor.element_size(),
                        shape=tensor.shape, dtype=tensor.dtype, version=tensor._version)
        self._records[index] = rec
        if home != Home.RECOMPUTE:
            rec.device = tensor.detach()  # detached: the store must not hold the graph
            self._acct.allocate("device", rec.nbytes)

    def has(self, index: int) -> bool:
        rec = self._records.get(index)
        return rec is not None and rec.home != Home.RECOMPUTE

    def where(self, index: int) -> set[str]:
        """Tiers holding boundary `index` right now (for tests and reports)."""
        rec = self._records.get(index)
        if rec is None:
            return set()
        tiers = {"device"} if rec.device is not None else set()
        if rec.host is not None:
            tiers.add("host")
        if rec.on_nvme:
            tiers.add("nvme")
        return tiers

    def run_window(self, window: int) -> None:
        """Issue the transfers the plan assigns to `window`, once per store."""
        if window in self._done_windows:
            return
        self._done_windows.add(window)
        self._reap()
        stages = {TransferKind.D2H: self._d2h, TransferKind.NVME_WRITE: self._nvme_write,
                  TransferKind.NVME_READ: self._nvme_read, TransferKind.H2D: self._h2d}
        for index, kind in self._by_window.get(window, []):
            rec = self._records.get(index)
            if rec is not None and rec.home in (Home.CPU, Home.NVME):
                if kind in (TransferKind.NVME_WRITE, TransferKind.NVME_READ) \
                        and rec.home != Home.NVME:
                    continue
                stages[kind](rec)

    # ---- stages --------------------------------------------------------------------
    def _check_version(self, rec: _Boundary) -> None:
        if rec.device is not None and rec.device._version != rec.version:
            raise BoundaryModifiedError(
                f"boundary {rec.index} was modified in place after the engine stored it "
                f"(version {rec.version} -> {rec.device._version}); the backward would use "
                "wrong values. Make the in-place op out of place (e.g. `x = x + y`)")

    def _d2h(self, rec: _Boundary) -> None:
        if rec.host is not None or rec.on_nvme or rec.device is None:
            return
        self._check_version(rec)
        rec.host = self._streams.empty_host(rec.shape, rec.dtype)
        with self._streams.copy_stream("d2h"), self._acct.timed_transfer("d2h", rec.nbytes):
            self._streams.copy_(rec.host, rec.device)
            self._streams.keep_alive(rec.device)
            rec.host_ready = self._streams.record()
        self._acct.allocate(self._streams.host_tier, rec.nbytes)
        rec.device = None
        self._acct.free("device", rec.nbytes)

    def _nvme_write(self, rec: _Boundary) -> None:
        if rec.write is not None or rec.on_nvme:
            return
        self._d2h(rec)
        self._stall_on(lambda: self._streams.host_waits(rec.host_ready))
        rec.write = self._spill.write(self._name(rec), rec.host, index=rec.index)

    def _nvme_read(self, rec: _Boundary) -> None:
        if rec.host is not None or rec.read is not None or rec.device is not None:
            return
        self._nvme_write(rec)  # no-op once written; the read queues after the write
        rec.host = self._streams.empty_host(rec.shape, rec.dtype)
        self._acct.allocate(self._streams.host_tier, rec.nbytes)
        rec.read = self._spill.read(self._name(rec), rec.host, index=rec.index)

    def _h2d(self, rec: _Boundary) -> None:
        if rec.device is not None:
            return
        if rec.home == Home.NVME:
            if rec.host is None:
                self._nvme_read(rec)
            if rec.read is not None:
                self._stall_on(rec.read.result)
        else:
            self._d2h(rec)
        self._stall_on(lambda: self._streams.host_waits(rec.host_ready))
        # allocated on the compute stream, which reads and frees it; written on the side one
        rec.device = torch.empty(rec.shape, dtype=rec.dtype, device=self._streams.device)
        with self._streams.copy_stream("h2d"), self._acct.timed_transfer("h2d", rec.nbytes):
            self._streams.copy_(rec.device, rec.host)
            self._streams.keep_alive(rec.device)
            rec.device_ready = self._streams.record()
        rec.version = rec.device._version
        self._acct.allocate("device", rec.nbytes)

    def _reap(self, *, wait: bool = False) -> None:
        """Free the host copy of every boundary whose NVMe write has completed."""
        for rec in self._records.values():
            if rec.write is None or rec.on_nvme:
                continue
            if wait:
                self._stall_on(rec.write.result)
            if rec.write.done():
                rec.write.result()  # re-raise an I/O error here, on the training thread
                rec.on_nvme = True
                if rec.read is None and rec.host is not None:
                    rec.host = None
                    self._acct.free(self._streams.host_tier, rec.nbytes)

    # ---- backward ------------------------------------------------------------------
    def fetch(self, index: int) -> torch.Tensor:
        """The device tensor of materialized boundary `index`, reloading it if needed."""
        rec = self._records.get(index)
        if rec is None or rec.home == Home.RECOMPUTE:
            raise RuntimeError(f"boundary {index} was not stored (home "
                               f"{rec.home.value if rec else 'unknown'}); was backward run "
                               "twice through one graph? retain_graph is not supported")
        if rec.device is None:
            self._h2d(rec)
        self._check_version(rec)
        with self._acct.stalled():  # blocks the host where compute is the host's thread
            self._streams.compute_waits(rec.device_ready)
        return rec.device

    def release(self, index: int) -> None:
        """Drop every copy of boundary `index` (its backward is done)."""
        rec = self._records.pop(index, None)
        if rec is None:
            return
        if rec.write is not None or rec.on_nvme:
            self._spill.remove(self._name(rec), index=rec.index)
        if rec.write is not None and not rec.on_nvme:  # consumed from its host copy
            self._unchecked_writes.append(rec.write)
        if rec.device is not None:
            self._acct.free("device", rec.nbytes)
        if rec.host is not None:
            self._acct.free(self._streams.host_tier, rec.nbytes)

    def close(self) -> None:
        """Release everything (end of the backward, an exception, or garbage collection)."""
        for index in list(self._records):
            self.release(index)

    def check_writes(self) -> None:
        """Raise the I/O error of a write whose boundary the backward took from its host
        copy before the write was seen to finish: a failed write fails the step (before
        its update) however the boundary came back. Waits for such writes to finish."""
        unchecked, self._unchecked_writes = self._unchecked_writes, []
        for write in unchecked:
            self._stall_on(write.result)

    def sync(self) -> None:
        """Wait for background writes and free the host copies they made redundant."""
        self._reap(wait=True)

    def _name(self, rec: _Boundary) -> str:
        return f"{self._tag}-b{rec.index}.bin"

    def _stall_on(self, wait: Callable[[], object]) -> None:
        with self._acct.stalled():
            wait()
