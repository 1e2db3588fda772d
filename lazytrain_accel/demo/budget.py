"""The demo's device budget: small enough that the plan has to place boundaries.

On a CPU, or on any GPU, the demo model's activations fit the device many times over and
the plan would keep everything on it. The demo instead plans for a device that holds the
fixed working set (weight buffers, one layer's backward, residents, staging) and about a
third of the boundaries, so the printed plan shows offload and recompute doing their job.
"""

from __future__ import annotations

import math

from lazytrain_accel.planning.problem import GPU_RESERVE_FRACTION, build_problem
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile

GIB = 2**30


def demo_gpu_budget_gb(model: ModelProfile, hardware: HardwareProfile, *,
                       boundary_fraction: float = 1 / 3) -> float:
    """GiB of device memory that holds the fixed bytes plus `boundary_fraction` of the
    L + 1 boundaries, reserve included (the planner keeps `GPU_RESERVE_FRACTION` free)."""
    if not 0 < boundary_fraction <= 1:
        raise ValueError(f"boundary_fraction={boundary_fraction} must be in (0, 1]")
    problem = build_problem(model, hardware)
    fixed_bytes = problem.static_gpu_bytes + problem.staging_boundaries * model.boundary_bytes
    kept = max(2, math.ceil(boundary_fraction * (model.num_layers + 1)))
    budget_bytes = (fixed_bytes + kept * model.boundary_bytes) / (1 - GPU_RESERVE_FRACTION)
    return budget_bytes / GIB
