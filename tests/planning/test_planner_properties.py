"""Property test over random chains (issue 15): whatever the MIP returns executes.

Every instance either plans or is refused with `PlanInfeasibleError`; a plan simulates
without deadlock, its simulated step equals the MIP's objective (plus the step's fixed
floor) within 1%, its simulated peaks respect every budget, and no baseline feasible in
the same budgets is faster. Mostly small chains (cheap solves), a few deep ones.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from planner_chains import property_chains

from lazytrain_accel.planning import PlanInfeasibleError, build_problem, make_plan, simulate
from lazytrain_accel.planning.baselines import BASELINES
from lazytrain_accel.planning.no_solver import evaluate_fixed
from lazytrain_accel.planning.request import PlanRequest


def _plan(instance: tuple, strategy: str):
    model, hardware, budgets, K = instance
    try:
        return make_plan(model, hardware, PlanRequest(strategy=strategy, budgets=budgets,
                                                      max_recompute_block=K, time_limit_s=20))
    except PlanInfeasibleError:
        return None


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(property_chains())
def test_every_plan_executes_as_solved(instance: tuple) -> None:
    model, hardware, budgets, K = instance
    plan = _plan(instance, "lazytrain")
    if plan is None:
        return
    result = simulate(plan, model, hardware, include_optimizer=False)  # never deadlocks
    p = build_problem(model, hardware, budgets=budgets, max_recompute_block=K)
    assert result.step_s == pytest.approx(p.step_floor_s() + plan.solver.objective_s,
                                          rel=0.01)
    pred = plan.prediction
    assert pred.peak_gpu_bytes <= budgets.gpu_bytes
    assert pred.peak_cpu_bytes <= budgets.cpu_bytes
    assert pred.peak_nvme_bytes <= budgets.nvme_bytes
    for name, homes_of in BASELINES.items():
        if not evaluate_fixed(p, homes_of(p)).feasible:  # skip the refusal's diagnosis
            continue
        baseline = _plan(instance, name)
        if baseline is not None:
            other = simulate(baseline, model, hardware, include_optimizer=False)
            assert result.step_s <= other.step_s * (1 + 2e-3), name
