"""Rates that belong to a workload, cached under it and never applied to another.

A machine's links, drive and host update rate hold for any model (`measure.py` caches them
per machine). The compute rate and the step's fitted overhead do not: a 128-wide layer
and a 4096-wide one reach different fractions of a roofline, and the overhead fitted on
one run holds that run's head, loss and data loading. They are kept per workload: the
model's geometry and trainable split, the batch shape, the compute dtype, the device and
the thread count (`workload_key`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile

logger = logging.getLogger("lazytrain_accel")

#: The `HardwareProfile` fields a workload owns.
WORKLOAD_FIELDS = ("achieved_flops_per_s", "step_overhead_s")


@dataclass(frozen=True, kw_only=True)
class WorkloadRates:
    achieved_flops_per_s: float  # the model's own layers and head at the batch shape
    #: the step's overhead a run fitted (`calibration.StepOverheadFit`); None: not fitted,
    #: the machine's probe (`layer_probe.py`) stands
    step_overhead_s: float | None = None
    source: str = ""


def workload_key(profile: ModelProfile, *, device_name: str, threads: int) -> str:
    """The key of `profile`'s workload on `device_name` at `threads` torch threads."""
    geometry = profile.geometry.to_dict()
    geometry.pop("name")
    key = {"geometry": geometry, "batch_size": profile.batch_size, "seq_len": profile.seq_len,
           "compute_bytes_per_elem": profile.compute_bytes_per_elem,
           "weights": None if profile.weights is None else profile.weights.to_dict(),
           "device": device_name, "threads": threads}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / "workloads" / f"{key}.json"


def load_workload(cache_dir: str, key: str) -> WorkloadRates | None:
    """The rates cached under `key`, or None (none yet, or a torn or foreign file)."""
    try:
        data = json.loads(_path(cache_dir, key).read_text())
        return WorkloadRates(**data)
    except (OSError, ValueError, TypeError):
        return None


def save_workload(cache_dir: str, key: str, rates: WorkloadRates) -> None:
    """Keep `rates` under `key` (written whole, then renamed: a reader never sees half)."""
    path = _path(cache_dir, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(rates), indent=1))
        tmp.replace(path)
    except OSError as err:  # a read-only cache must not stop training
        logger.warning("lazytrain: could not cache the workload's rates in %s (%s)", path, err)


def with_workload(hardware: HardwareProfile, rates: WorkloadRates) -> HardwareProfile:
    """`hardware` with `rates` in place of its compute rate (and fitted overhead)."""
    fields: dict[str, float] = {"achieved_flops_per_s": rates.achieved_flops_per_s}
    if rates.step_overhead_s is not None:
        fields["step_overhead_s"] = rates.step_overhead_s
    head, sep, base = hardware.source.partition(" | base: ")
    return dataclasses.replace(hardware, **fields,
                               source=f"{head}; workload: {rates.source}{sep}{base}")


def rates_of(hardware: HardwareProfile, *, source: str) -> WorkloadRates:
    """The workload's part of a (calibrated) `hardware`."""
    return WorkloadRates(achieved_flops_per_s=hardware.achieved_flops_per_s,
                         step_overhead_s=hardware.step_overhead_s, source=source)
