"""Rates that belong to a workload, cached under it and never applied to another.

The machine's probes (`measure.py`) hold for any model and are cached per machine. What
a run measures does not: a layer's share of the roofline depends on its width and the
batch shape, a run's copies and update run at the rates of its own tensor sizes, and a
fitted step overhead holds that run's head, loss and data loading (figures:
docs/user_guide.md "Who measures, who plans, what is cached"). So the compute rate timed
at `prepare` and every rate a run calibrates are kept per workload (`workload_key`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from lazytrain_accel.profiling.calibration import RATE_FIELDS
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile

logger = logging.getLogger("lazytrain_accel")

#: The `HardwareProfile` fields a workload may own: every calibrated rate, the fitted
#: step overhead.
WORKLOAD_FIELDS = (*RATE_FIELDS.values(), "step_overhead_s")


@dataclass(frozen=True, kw_only=True)
class WorkloadRates:
    #: `WORKLOAD_FIELDS` values measured on this workload (the compute rate timed at
    #: `prepare`; a run's calibrated rates and fitted step overhead)
    rates: dict[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        foreign = sorted(set(self.rates) - set(WORKLOAD_FIELDS))
        if foreign:
            raise ValueError(f"WorkloadRates.rates has {foreign}: a workload owns only "
                             f"{list(WORKLOAD_FIELDS)}")


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
        return WorkloadRates(rates={k: float(v) for k, v in data["rates"].items()},
                             source=str(data["source"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
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
    """`hardware` with the workload's `rates` in place of its own."""
    head, sep, base = hardware.source.partition(" | base: ")
    return dataclasses.replace(hardware, **rates.rates,
                               source=f"{head}; workload: {rates.source}{sep}{base}")


def rates_of(hardware: HardwareProfile, *, source: str) -> WorkloadRates:
    """The workload's part of a (calibrated) `hardware`: every `WORKLOAD_FIELDS` rate it
    prices (a host work rate of 0 is not priced, so not kept)."""
    return WorkloadRates(rates={name: float(getattr(hardware, name)) for name in WORKLOAD_FIELDS
                                if getattr(hardware, name) > 0 or name == "step_overhead_s"},
                         source=source)
