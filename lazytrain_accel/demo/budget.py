"""The demo's device budget: what the MegaTrain baseline needs, and not a byte more.

On a CPU, or on any GPU, the demo model's activations fit the device many times over and
every plan would keep everything on it. The demo instead plans for a device just large
enough for MegaTrain's schedule (a checkpoint every 4 layers kept on the device, the
layers between recomputed), so both columns of the printed plan are feasible and the
LazyTrain plan has to decide what to offload or recompute within the same memory.
"""

from __future__ import annotations

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan, simulate
from lazytrain_accel.planning.problem import GPU_RESERVE_FRACTION
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile

GIB = 2**30
#: The planner's capacity model charges a little more than the simulated peak (staging
#: slots, reserve); each retry adds the shortfall it reports.
_MAX_TRIES = 4


def demo_gpu_budget_gb(model: ModelProfile, hardware: HardwareProfile) -> float:
    """The smallest GiB budget (found from MegaTrain's simulated peak, raised by the
    shortfall the planner reports) within which the MegaTrain plan is feasible."""
    baseline = make_plan(model, hardware, PlanRequest(strategy="megatrain"))
    budget_bytes = simulate(baseline, model, hardware).peak_gpu_bytes / (1 - GPU_RESERVE_FRACTION)
    for _ in range(_MAX_TRIES):
        budgets = Budgets.from_hardware(hardware, gpu_memory_limit_gb=budget_bytes / GIB)
        try:
            make_plan(model, hardware, PlanRequest(strategy="megatrain", budgets=budgets))
            return budget_bytes / GIB
        except PlanInfeasibleError as err:
            shortfall = err.shortfall_bytes.get("gpu", 0)
            if shortfall <= 0:
                raise
            budget_bytes += shortfall / (1 - GPU_RESERVE_FRACTION) + 1
    raise RuntimeError(f"no MegaTrain-sized budget found after {_MAX_TRIES} tries (last "
                       f"{budget_bytes / 2**20:.1f} MiB); pass --gpu-memory-gb explicitly")
