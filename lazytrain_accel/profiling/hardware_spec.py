"""`load_hardware`: a hardware spec (preset name, JSON file or "auto") to a profile.

Apart from `hardware.py` so that `measure.py` (which builds a `HardwareProfile`) and this
dispatcher (which calls `measure.py` for "auto") do not import each other.
"""

from __future__ import annotations

from pathlib import Path

from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.suggest import did_you_mean


def load_hardware(spec: str, *, cache_dir: str | None = None, nvme_dir: str | None = None,
                  refresh: bool = False) -> HardwareProfile:
    """The profile named by `spec`: a preset name, a JSON file, or "auto" (measure here).

    "auto" measures this machine once and caches the result in `cache_dir`; `refresh=True`
    measures again. NVMe is measured in `nvme_dir`. Profiling reads no environment: callers
    pass the config's directories (`LazyTrainConfig.cache_dir`, or `env_setting("cache_dir")`
    without a config).
    """
    key = spec.strip().lower()
    if key == "auto":
        if cache_dir is None or nvme_dir is None:
            raise ValueError('load_hardware("auto") measures this machine and needs cache_dir '
                             "and nvme_dir: pass the config's (e.g. "
                             'env_setting("cache_dir"), env_setting("nvme_dir"))')
        # measure.py imports torch; a preset or a JSON file must load without it.
        from lazytrain_accel.profiling.measure import measure_hardware

        return measure_hardware(cache_dir=cache_dir, nvme_dir=nvme_dir, refresh=refresh)
    if key in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[key]
    path = Path(spec).expanduser()
    if path.suffix == ".json" or path.is_file():
        return HardwareProfile.load(path)
    raise ValueError(f"hardware {spec!r} is not valid: {did_you_mean(spec, HARDWARE_PRESETS)}"
                     f"use 'auto', one of {sorted(HARDWARE_PRESETS)}, or the path of a "
                     "hardware JSON file")
