"""Property test over random chains (issue 15): whatever the MIP returns executes.

Every instance either plans or is refused with a `PlanInfeasibleError` that names each
tier it is short in; a plan simulates without deadlock, its simulated step equals the
MIP's objective (plus the step's fixed floor) within 1%, its simulated peaks respect
every budget, and no baseline feasible in the same budgets is faster. Mostly small chains
(cheap solves), a few deep ones; most instances plan (a planner that refuses what it
used to plan fails the share below).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from planner_chains import property_chains

from lazytrain_accel.planning import PlanInfeasibleError, build_problem, make_plan, simulate
from lazytrain_accel.planning.baselines import BASELINES
from lazytrain_accel.planning.no_solver import evaluate_fixed
from lazytrain_accel.planning.refusal import readable_bytes
from lazytrain_accel.planning.request import PlanRequest

EXAMPLES = 200
#: The share of the instances that must plan (125 of the 200 derandomized draws did when
#: this was set; the floor leaves room for budgets drawn differently, not for a planner
#: that refuses half of what it planned).
MIN_PLANNED_SHARE = 0.5


def _plan(instance: tuple, strategy: str):
    """The plan, or the refusal."""
    model, hardware, budgets, K = instance
    try:
        return make_plan(model, hardware, PlanRequest(strategy=strategy, budgets=budgets,
                                                      max_recompute_block=K, time_limit_s=20))
    except PlanInfeasibleError as err:
        return err


def test_every_plan_executes_as_solved() -> None:
    planned: list[bool] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(property_chains())
    def check(instance: tuple) -> None:
        plan = _plan(instance, "lazytrain")
        planned.append(not isinstance(plan, PlanInfeasibleError))
        if isinstance(plan, PlanInfeasibleError):
            _check_refusal(plan)
        else:
            _check_plan(instance, plan)

    check()
    assert len(planned) == EXAMPLES
    assert sum(planned) >= MIN_PLANNED_SHARE * EXAMPLES, f"{sum(planned)} of {EXAMPLES} planned"


def _check_refusal(err: PlanInfeasibleError) -> None:
    """A refusal names each tier it is short in, with the bytes it lacks."""
    assert err.shortfall_bytes, f"a refusal that names no tier: {err}"
    for tier, short_bytes in err.shortfall_bytes.items():
        assert tier in ("gpu", "cpu", "nvme") and short_bytes > 0, err.shortfall_bytes
        assert f"{tier.upper()} short by {readable_bytes(short_bytes)}" in str(err), str(err)


def _check_plan(instance: tuple, plan) -> None:
    model, hardware, budgets, K = instance
    result = simulate(plan, model, hardware, include_optimizer=False)  # never deadlocks
    p = build_problem(model, hardware, budgets=budgets, max_recompute_block=K)
    assert result.step_s == pytest.approx(p.step_floor_s() + plan.solver.objective_s,
                                          rel=0.01)
    # the re-runs the benches and calibration count are those the cost model charges
    assert plan.recomputed_layer_runs * p.fwd_run_s == pytest.approx(
        sum(p.recompute_s(s, e) for s, e in plan.blocks))
    pred = plan.prediction
    assert pred.peak_gpu_bytes <= budgets.gpu_bytes
    assert pred.peak_cpu_bytes <= budgets.cpu_bytes
    assert pred.peak_nvme_bytes <= budgets.nvme_bytes
    for name, homes_of in BASELINES.items():
        if not evaluate_fixed(p, homes_of(p)).feasible:  # skip the refusal's diagnosis
            continue
        baseline = _plan(instance, name)
        if not isinstance(baseline, PlanInfeasibleError):
            other = simulate(baseline, model, hardware, include_optimizer=False)
            assert result.step_s <= other.step_s * (1 + 2e-3), name
