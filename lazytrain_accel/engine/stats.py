"""Per-step accounting: peak bytes per memory tier and measured seconds per activity.

The measured counterpart of the simulator's `Prediction` (planning/simulate.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

#: Memory tiers the engine accounts for.
TIERS: tuple[str, ...] = ("device", "host_pinned", "host_pageable", "nvme")
#: Transfer kinds timed separately; the first four are the plan's `TransferKind`s.
TRANSFER_KINDS: tuple[str, ...] = (
    "d2h", "nvme_write", "nvme_read", "h2d", "weights_h2d", "grads_d2h",
)


@dataclass(kw_only=True)
class StepStats:
    """What the engine measured since the last `reset_stats()`."""

    compute_s: float = 0.0  # layer forwards and backwards (their re-run included)
    recompute_s: float = 0.0  # regenerating boundaries of recompute blocks
    stall_s: float = 0.0  # main thread waiting on a transfer or an optimizer update
    optimizer_wait_s: float = 0.0  # of stall_s, waiting on the layer-wise update (exposure)
    optimizer_update_s: float = 0.0  # the layer-wise update's own run time, on its thread
    # the residents' update on the device (resident_update "device"), on the training
    # thread before the layer-wise update starts (on a GPU: the time to queue it)
    device_update_s: float = 0.0
    transfer_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0.0))
    transfer_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0))
    peak_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    current_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    layer_forwards: int = 0
    layer_backwards: int = 0
    layer_recomputes: int = 0


class Accounting:
    """Thread-safe counters behind `StepStats` (the NVMe worker reports from its thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StepStats()

    def reset(self) -> None:
        with self._lock:
            current = dict(self._stats.current_bytes)
            self._stats = StepStats(current_bytes=current, peak_bytes=dict(current))

    def snapshot(self) -> StepStats:
        with self._lock:
            s = self._stats
            return StepStats(
                compute_s=s.compute_s, recompute_s=s.recompute_s, stall_s=s.stall_s,
                optimizer_wait_s=s.optimizer_wait_s, optimizer_update_s=s.optimizer_update_s,
                device_update_s=s.device_update_s, transfer_s=dict(s.transfer_s),
                transfer_bytes=dict(s.transfer_bytes),
                peak_bytes=dict(s.peak_bytes), current_bytes=dict(s.current_bytes),
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
            self._stats.transfer_s[kind] += seconds
            self._stats.transfer_bytes[kind] += nbytes

    def add(self, name: str, amount: float) -> None:
        """Add to a scalar field: compute_s, recompute_s, stall_s or a layer counter."""
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + amount)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    @contextmanager
    def timed_transfer(self, kind: str, nbytes: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_transfer(kind, time.perf_counter() - start, nbytes)
