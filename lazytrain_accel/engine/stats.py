"""Per-step accounting: peak bytes per memory tier and measured seconds per activity.

The measured counterpart of the simulator's `Prediction` (planning/simulate.py).

Seconds of device work (a layer's compute, a copy on a link) are measured by the stream
backend's `Clock`, where the work runs: CUDA events on a GPU (a host clock would see only
the time to queue it), the side stream's worker thread on the emulated device, the wall
clock on a synchronous CPU. Such an interval may still be running when its region ends on
the host; it is added once it has completed, and `snapshot()` waits for those still
pending. Waits that block the host (`stall_s`) stay on the host clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

#: Memory tiers the engine accounts for.
TIERS: tuple[str, ...] = ("device", "host_pinned", "host_pageable", "nvme")
#: Transfer kinds timed separately; the first four are the plan's `TransferKind`s.
TRANSFER_KINDS: tuple[str, ...] = (
    "d2h", "nvme_write", "nvme_read", "h2d", "weights_h2d", "grads_d2h",
    "state_nvme_write", "state_nvme_read",  # the host state homed on NVMe (`Plan.state`)
    "state_nvme",  # both directions: bytes over the time the drive was busy with either
)
#: The host's own work per transfer on an async device, on the training thread
#: (`Accounting.host_work`): a layer's weights cast into a pinned staging buffer before
#: their H2D copy, a layer's gradients folded from their staging buffer into `.grad`
#: (with their norms) after their D2H copy. Bytes are the device copy's.
HOST_WORK_KINDS: tuple[str, ...] = ("weights_stage", "grads_fold")


class Interval(Protocol):
    """The time between two points of one stream's work, as that stream ran it."""

    def query(self) -> bool:
        """Whether both points have been reached (`seconds()` will not block)."""
        ...

    def seconds(self) -> float:
        """Elapsed seconds; blocks until the work between the points has run."""
        ...


class Clock(Protocol):
    """Times work on the stream in use (`Streams` implements it per backend)."""

    def start_interval(self) -> Callable[[], Interval]:
        """Mark a start on the stream in use now; the returned `stop()`, called later on
        the same stream, marks the end and returns the interval between."""
        ...


@dataclass(frozen=True)
class ElapsedInterval:
    """An interval already over, measured on the host."""

    elapsed_s: float

    def query(self) -> bool:
        return True

    def seconds(self) -> float:
        return self.elapsed_s


class WallClock:
    """The host's clock: right where the work runs on the host thread that issues it."""

    def start_interval(self) -> Callable[[], Interval]:
        start = time.perf_counter()
        return lambda: ElapsedInterval(time.perf_counter() - start)


@dataclass(kw_only=True)
class StepStats:
    """What the engine measured since the last `reset_stats()`."""

    compute_s: float = 0.0  # layer forwards and backwards (their re-run included)
    recompute_s: float = 0.0  # regenerating boundaries of recompute blocks
    # the training thread blocked waiting: on a transfer's event (on the emulated device,
    # compute is that thread, so its stream waits count), an NVMe read or write, a staging
    # buffer, or the layer-wise update (`Accounting.stalled`); host work is not a stall
    stall_s: float = 0.0
    optimizer_wait_s: float = 0.0  # of stall_s, waiting on the layer-wise update (exposure)
    # the layer-wise update's own run time, on its thread: not its waits for the state's
    # reads from NVMe or a checkpoint's gate (what the re-planner's host update rate reads)
    optimizer_update_s: float = 0.0
    # the residents' update on the device (resident_update "device"), on the training
    # thread before the layer-wise update starts (on a GPU: the time to queue it)
    device_update_s: float = 0.0
    transfer_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0.0))
    transfer_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0))
    host_work_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(HOST_WORK_KINDS, 0.0))
    host_work_bytes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(HOST_WORK_KINDS, 0))
    peak_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    current_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    layer_forwards: int = 0
    layer_backwards: int = 0
    layer_recomputes: int = 0


class Accounting:
    """Thread-safe counters behind `StepStats` (the NVMe worker reports from its thread);
    `timed` and `timed_transfer` measure with `clock` (default: the host's).

    Two views of the same counts: the period since `reset()` (`snapshot`, what progress
    lines and the fidelity monitor read and reset) and the run's totals, never reset
    (`totals`, which a reader takes differences of, as the re-planner does per step)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._lock = threading.Lock()
        self._stats = StepStats()
        self._totals = StepStats()
        self._clock: Clock = clock if clock is not None else WallClock()
        self._period = 0  # reset() count: a pending interval of an earlier period is
        # added to the totals only
        # (scalar field or transfer kind, is a transfer, interval, period) not yet completed
        self._pending: list[tuple[str, bool, Interval, int]] = []

    def reset(self) -> None:
        with self._lock:
            current = dict(self._stats.current_bytes)
            self._stats = StepStats(current_bytes=current, peak_bytes=dict(current))
            self._period += 1  # pending intervals of the period before: not this one's

    def snapshot(self) -> StepStats:
        """The counts since the last `reset()` (waits for pending intervals)."""
        return self._copy(lambda: self._stats)

    def totals(self) -> StepStats:
        """The counts since this accounting was made, whatever was reset since (waits for
        pending intervals); peaks and current bytes are the period's."""
        return self._copy(lambda: self._totals)

    def _copy(self, which: Callable[[], StepStats]) -> StepStats:
        self._settle(block=True)
        with self._lock:
            s, now = which(), self._stats
            return StepStats(
                compute_s=s.compute_s, recompute_s=s.recompute_s, stall_s=s.stall_s,
                optimizer_wait_s=s.optimizer_wait_s, optimizer_update_s=s.optimizer_update_s,
                device_update_s=s.device_update_s, transfer_s=dict(s.transfer_s),
                transfer_bytes=dict(s.transfer_bytes), host_work_s=dict(s.host_work_s),
                host_work_bytes=dict(s.host_work_bytes),
                peak_bytes=dict(now.peak_bytes), current_bytes=dict(now.current_bytes),
                layer_forwards=s.layer_forwards, layer_backwards=s.layer_backwards,
                layer_recomputes=s.layer_recomputes,
            )

    def allocate(self, tier: str, nbytes: int) -> None:
        with self._lock:
            cur = self._stats.current_bytes[tier] + nbytes
            self._stats.current_bytes[tier] = cur
            self._stats.peak_bytes[tier] = max(self._stats.peak_bytes[tier], cur)

    def free(self, tier: str, nbytes: int) -> None:
        self.allocate(tier, -nbytes)

    def add_transfer(self, kind: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            for stats in (self._stats, self._totals):
                stats.transfer_s[kind] += seconds
                stats.transfer_bytes[kind] += nbytes

    def add(self, name: str, amount: float) -> None:
        """Add to a scalar field: compute_s, recompute_s, stall_s or a layer counter."""
        with self._lock:
            for stats in (self._stats, self._totals):
                setattr(stats, name, getattr(stats, name) + amount)

    @contextmanager
    def stalled(self) -> Iterator[None]:
        """Add the host seconds the enclosed wait blocks the calling (training) thread to
        `stall_s`. Wrap the wait alone: copies and bookkeeping around it are work."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add("stall_s", time.perf_counter() - start)

    @contextmanager
    def host_work(self, kind: str, nbytes: int) -> Iterator[None]:
        """Add the host seconds of the enclosed work the training thread does for a
        transfer of `nbytes` (`HOST_WORK_KINDS`); no wait inside (wrap those in
        `stalled`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                for stats in (self._stats, self._totals):
                    stats.host_work_s[kind] += seconds
                    stats.host_work_bytes[kind] += nbytes

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the seconds of the work the enclosed code runs or queues on the stream in
        use to the scalar field `name`."""
        stop = self._clock.start_interval()
        try:
            yield
        finally:
            self._add_interval(name, False, stop())

    @contextmanager
    def timed_transfer(self, kind: str, nbytes: int) -> Iterator[None]:
        """Time a transfer of `nbytes` on link `kind`; inside the link's `copy_stream`, so
        the clock times the link's own work."""
        stop = self._clock.start_interval()
        try:
            yield
        finally:
            self.add_transfer(kind, 0.0, nbytes)
            self._add_interval(kind, True, stop())

    def _add_interval(self, name: str, transfer: bool, interval: Interval) -> None:
        with self._lock:
            self._pending.append((name, transfer, interval, self._period))
        self._settle(block=False)

    def _settle(self, *, block: bool) -> None:
        """Add the pending intervals that have completed (all of them when `block`)."""
        with self._lock:
            ready, waiting = [], []
            for entry in self._pending:  # one query each: an interval may end meanwhile
                (ready if block or entry[2].query() else waiting).append(entry)
            self._pending = waiting
        # resolved outside the lock: waiting on a stream must not hold up other threads
        resolved = [(name, transfer, interval.seconds(), period)
                    for name, transfer, interval, period in ready]
        with self._lock:
            for name, transfer, seconds, period in resolved:
                for stats in (self._totals, self._stats) if period == self._period \
                        else (self._totals,):
                    if transfer:
                        stats.transfer_s[name] += seconds
                    else:
                        setattr(stats, name, getattr(stats, name) + seconds)
