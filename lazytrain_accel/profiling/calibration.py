"""Calibration: a hardware profile's rates fitted to what a run measured (no torch).

The engine times each copy on the link that runs it, so bytes over seconds of copies is
the link's rate with waits left out; the layers' compute against their FLOPs gives the
compute rate, the layer-wise update's seconds the host optimizer's. `RateEstimate` keeps
the median of the recent steps and says when those medians have settled; `calibrate`
writes them into a copy of the profile. The step's own overhead, which no rate prices, is
fitted as a time (`StepOverheadFit`: the median of the measured step less the simulated
one without it). Docs: docs/planner.md "Re-planning".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from lazytrain_accel.profiling.hardware import HardwareProfile

#: The engine's transfer kinds (engine/stats.py `TRANSFER_KINDS`) that cross each link:
#: the drive's, the boundaries' hops and the host state's I/O (each its busy time).
LINK_KINDS: dict[str, tuple[str, ...]] = {
    "h2d": ("h2d", "weights_h2d"), "d2h": ("d2h", "grads_d2h"),
    "nvme_read": ("nvme_read", "state_nvme_read"),
    "nvme_write": ("nvme_write", "state_nvme_write"),
}
#: The host's work per transfer (engine/stats.py `HOST_WORK_KINDS`) behind each rate.
HOST_WORK_RATES: dict[str, str] = {"host_stage": "weights_stage", "host_fold": "grads_fold"}
#: The profile field each calibrated rate replaces.
RATE_FIELDS: dict[str, str] = {
    "h2d": "h2d_bytes_per_s", "d2h": "d2h_bytes_per_s",
    "nvme_read": "nvme_read_bytes_per_s", "nvme_write": "nvme_write_bytes_per_s",
    "compute": "achieved_flops_per_s", "host_update": "cpu_optimizer_params_per_s",
    "host_stage": "host_stage_bytes_per_s", "host_fold": "host_fold_bytes_per_s",
}
#: A rate is not estimated from a step that measured less than this of it: timer noise.
MIN_MEASURED_S = 1e-3
#: The median is over this many recent steps: one outlier step in three moves nothing.
WINDOW_STEPS = 3
#: Settled: each median moved by at most `TOLERANCE` over this many steps: about what a
#: busy machine's steps vary by (docs/benchmarks.md "Re-planning on measured rates"); a
#: drift that matters is larger.
SETTLE_STEPS = 2
TOLERANCE = 0.2


@dataclass(frozen=True, kw_only=True)
class StepSample:
    """What one optimizer step measured, in the units the rates need."""

    transfer_s: Mapping[str, float]  # per transfer kind, copies only (no waits)
    transfer_bytes: Mapping[str, int]
    layer_compute_s: float  # the streamed layers' forwards, backwards and recomputes
    layer_flops: float  # the FLOPs of those runs
    optimizer_update_s: float  # the host's layer-wise update
    updated_param_count: int  # parameters that update stepped
    # per `HOST_WORK_KINDS`, the training thread's own work for the transfers (async device)
    host_work_s: Mapping[str, float] = field(default_factory=dict)
    host_work_bytes: Mapping[str, int] = field(default_factory=dict)


def step_rates(sample: StepSample) -> dict[str, float]:
    """The rates one step shows, by `RATE_FIELDS` key; a rate the step barely used is
    left out."""
    rates: dict[str, float] = {}
    for link, kinds in LINK_KINDS.items():
        seconds = sum(sample.transfer_s.get(kind, 0.0) for kind in kinds)
        nbytes = sum(sample.transfer_bytes.get(kind, 0) for kind in kinds)
        if seconds >= MIN_MEASURED_S and nbytes > 0:
            rates[link] = nbytes / seconds
    if sample.layer_compute_s >= MIN_MEASURED_S and sample.layer_flops > 0:
        rates["compute"] = sample.layer_flops / sample.layer_compute_s
    if sample.optimizer_update_s >= MIN_MEASURED_S and sample.updated_param_count > 0:
        rates["host_update"] = sample.updated_param_count / sample.optimizer_update_s
    for name, kind in HOST_WORK_RATES.items():
        seconds, nbytes = sample.host_work_s.get(kind, 0.0), sample.host_work_bytes.get(kind, 0)
        if seconds >= MIN_MEASURED_S and nbytes > 0:
            rates[name] = nbytes / seconds
    return rates


class RateEstimate:
    """The median of each rate over the last `window_steps` steps that measured it; it has
    settled when every median moved by at most `tolerance` over `settle_steps` steps."""

    def __init__(self, *, window_steps: int = WINDOW_STEPS, settle_steps: int = SETTLE_STEPS,
                 tolerance: float = TOLERANCE) -> None:
        if window_steps < 1 or settle_steps < 1 or not tolerance > 0:
            raise ValueError(f"window_steps={window_steps} and settle_steps={settle_steps} "
                             f"must be >= 1, tolerance={tolerance} > 0")
        self.window_steps, self.settle_steps, self.tolerance = (window_steps, settle_steps,
                                                                tolerance)
        self._recent: dict[str, deque[float]] = {}
        self._history: deque[dict[str, float]] = deque(maxlen=settle_steps)

    def add(self, rates: Mapping[str, float]) -> None:
        """One step's rates (`step_rates`)."""
        for name, value in rates.items():
            self._recent.setdefault(name, deque(maxlen=self.window_steps)).append(value)
        self._history.append(self.medians())

    def recent(self, name: str) -> list[float]:
        """`name`'s values over the window (oldest first; fewer before it is full)."""
        return list(self._recent.get(name, ()))

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self._recent.items()}

    def settled(self, names: Collection[str] | None = None) -> bool:
        """Whether each rate of `names` (default: every rate measured) has a full window and
        its median stayed within `tolerance` over the last `settle_steps` steps."""
        names = self._recent.keys() if names is None else names
        if len(self._history) < self.settle_steps or not names:
            return False
        if any(len(self._recent.get(name, ())) < self.window_steps for name in names):
            return False
        last = self._history[-1]
        return all(max(ratio(h.get(name, last[name]), last[name]) for h in self._history)
                   <= 1 + self.tolerance for name in names)


class StepOverheadFit:
    """The step's own overhead, fitted: the median over the last `window_steps` steps of
    (measured step - simulated step of the plan it ran, at the calibrated rates and with
    no step overhead), floored at 0."""

    def __init__(self, *, window_steps: int = WINDOW_STEPS) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps={window_steps} must be >= 1")
        self._residuals: deque[float] = deque(maxlen=window_steps)

    def add(self, measured_step_s: float, modeled_step_s: float) -> None:
        """One step: its wall seconds, and the simulator's for its plan without the term."""
        self._residuals.append(measured_step_s - modeled_step_s)

    def recent(self) -> list[float]:
        return list(self._residuals)

    def full(self) -> bool:
        return len(self._residuals) == self._residuals.maxlen

    def step_overhead_s(self) -> float | None:
        """The fitted term, or None before any step."""
        if not self._residuals:
            return None
        return max(statistics.median(self._residuals), 0.0)


def with_step_overhead(hardware: HardwareProfile, step_overhead_s: float) -> HardwareProfile:
    """`hardware` (calibrated) with a fitted step overhead, noted in its source."""
    note = f", step overhead {step_overhead_s * 1e3:.3g} ms (fitted)"
    head, sep, base = hardware.source.partition(" | base: ")
    return replace(hardware, step_overhead_s=float(step_overhead_s),
                   source=f"{head}{note}{sep}{base}")


def ratio(a: float, b: float) -> float:
    """How far apart two positive rates are, as a factor >= 1."""
    return max(a, b) / min(a, b)


def calibrate(hardware: HardwareProfile, rates: Mapping[str, float], *,
              where: str) -> HardwareProfile:
    """`hardware` with the measured `rates` (`RATE_FIELDS` keys) in place of its own; its
    capacities and every rate not measured stay. `where` says what measured them."""
    fields = {RATE_FIELDS[name]: float(value) for name, value in rates.items()}
    name = hardware.name if hardware.name.startswith("calibrated-") \
        else f"calibrated-{hardware.name}"
    measured = ", ".join(format_rate(n, v) for n, v in rates.items())
    base = hardware.source.split(" | base: ", 1)[-1]
    return replace(hardware, name=name, **fields,
                   source=f"calibrated by {where}: {measured} | base: {base}")


def calibration_note(hardware: HardwareProfile) -> str | None:
    """What calibrated `hardware` and the rates it measured (`calibrate`'s note), or None
    for a profile no run calibrated."""
    if not hardware.name.startswith("calibrated-"):
        return None
    return hardware.source.split(" | base: ", 1)[0]


def drifts(planned: HardwareProfile, measured: HardwareProfile) -> list[tuple[str, float, float]]:
    """(rate, planned value, measured value) of every calibrated rate the plan priced, the
    one that drifted most first (a host work rate of 0 was not priced: nothing to drift
    from)."""
    rows = [(name, getattr(planned, f), getattr(measured, f)) for name, f in RATE_FIELDS.items()
            if getattr(planned, f) > 0 and getattr(measured, f) > 0]
    return sorted(rows, key=lambda r: -abs(math.log(r[2] / r[1])))


def format_rate(name: str, value: float) -> str:
    """A rate in the units people read: GB/s (MB/s, kB/s below 1 GB/s), TFLOPS,
    M params/s."""
    if name == "compute":
        return f"compute {value / 1e12:.3g} TFLOPS"
    if name == "host_update":
        return f"host update {value / 1e6:.3g} M params/s"
    scale, unit = next((s, u) for s, u in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"),
                                           (0.0, "B/s")) if value >= s)
    return f"{name} {value / (scale or 1):.3g} {unit}"
