"""`run_fingerprint`: what a plan depends on, hashed, so a plan is never used for another
run. Lives beside the profiles it reads; the `Plan` itself only stores and compares it."""

from __future__ import annotations

import hashlib
import json

from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile


def run_fingerprint(model: ModelProfile, hardware: HardwareProfile) -> str:
    """Hash of what a plan depends on and what stays put: model geometry, batch shape,
    the device and the device's and host's total memory.

    Rates are left out on purpose: re-measuring bandwidth on the same machine gives
    slightly different numbers and must not invalidate a plan. So is the drive's free
    space, a reading that moves whenever a file is written (two ranks reading it a moment
    apart fingerprinted two plans); the NVMe bytes a plan homes are checked against the
    free space before it runs (`preflight.check_nvme_dir`).
    """
    geometry = model.geometry.to_dict()
    geometry.pop("name")
    key = {
        "geometry": geometry,
        "batch_size": model.batch_size,
        "seq_len": model.seq_len,
        "compute_bytes_per_elem": model.compute_bytes_per_elem,
        "hardware": [hardware.gpu_name, hardware.gpu_memory_bytes, hardware.cpu_memory_bytes],
    }
    if model.weights is not None:  # LoRA / QLoRA: what trains and how the rest is stored
        key["weights"] = model.weights.to_dict()
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
