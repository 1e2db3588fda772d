"""The simulator has the last word: `make_plan` returns the fastest simulated plan that
fits among the MIP's pick, the baselines, and (during a re-plan) the running plan.

The MIP prices a plan by its window model; the simulator by one event-driven step with
the host update beside it. Where they disagree, or where the MIP answered a narrower
question than the one asked (residents kept on the GPU charged to its budget before the
solve), a plan the planner already has must not lose to the new one. The result says so
when the MIP's own pick lost (`Solution.mip_lost_to`, a log line).
Docs: docs/planner.md "The simulator has the last word".
"""

from __future__ import annotations

import dataclasses
import logging

from lazytrain_accel.planning.plan import Plan, PlanError
from lazytrain_accel.planning.problem import Budgets
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile

log = logging.getLogger(__name__)

#: A plan replaces the MIP's pick only when the simulator prices it this fraction faster:
#: equal plans (the same homes, found twice) keep the MIP's.
MIN_WIN = 1e-6


def fits(plan: Plan, budgets: Budgets) -> bool:
    """Whether `plan`'s simulated peaks are within `budgets` (as `make_plan` checks them)."""
    pred = plan.prediction
    return (pred.peak_gpu_bytes <= budgets.gpu_bytes and pred.peak_cpu_bytes
            <= budgets.cpu_bytes and pred.peak_nvme_bytes <= budgets.nvme_bytes)


def repriced(plan: Plan, model: ModelProfile, hardware: HardwareProfile, *,
             include_optimizer: bool) -> Plan | None:
    """`plan` with its prediction simulated on `hardware` (the running plan on measured
    rates), or None when it was made for another model or batch shape."""
    try:
        result = simulate(plan, model, hardware, include_optimizer=include_optimizer)
    except PlanError:
        return None
    return dataclasses.replace(plan, prediction=result.prediction())


def fastest(mip: Plan, others: list[tuple[str, Plan]], budgets: Budgets) -> Plan:
    """`mip`, or the named plan of `others` that fits `budgets` and simulates faster than
    it (the fastest such), marked as the MIP's pick's winner."""
    best_name, best = "", mip
    for name, plan in others:
        if fits(plan, budgets) and plan.prediction.step_s < (1 - MIN_WIN) * best.prediction.step_s:
            best_name, best = name, plan
    if not best_name:
        return mip
    message = (f"the MIP's plan simulates {mip.prediction.step_s:.4g} s a step, the "
               f"{best_name} plan {best.prediction.step_s:.4g} s: using the {best_name} plan")
    log.info("lazytrain: %s", message)
    solver = dataclasses.replace(best.solver, mip_lost_to=best_name,
                                 mip_step_s=mip.prediction.step_s,
                                 message="; ".join(m for m in (best.solver.message, message) if m))
    return dataclasses.replace(best, strategy=mip.strategy, solver=solver)
