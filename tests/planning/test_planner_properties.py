"""Property test over random chains (issue 15): whatever the MIP returns executes.

Every instance either plans or is refused with `PlanInfeasibleError`; a plan simulates
without deadlock, its simulated step equals the MIP's objective (plus the step's fixed
floor) within 1%, its simulated peaks respect every budget, and no baseline feasible in
the same budgets is faster. Mostly small chains (cheap solves), a few deep ones.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_chains import budgets_in_slots, chain

from lazytrain_accel.planning import PlanInfeasibleError, build_problem, make_plan, simulate
from lazytrain_accel.planning.baselines import BASELINES
from lazytrain_accel.planning.no_solver import evaluate_fixed

DEEP_LAYERS = (48, 64, 96)


@st.composite
def chains(draw: st.DrawFn) -> tuple:
    deep = draw(st.integers(0, 39)) == 0  # ~1 in 40 instances is 48-96 layers deep
    L = draw(st.sampled_from(DEEP_LAYERS)) if deep else draw(st.integers(4, 14))
    K = draw(st.sampled_from([1, 2, 3, 4, 8]))
    model, hardware = chain(
        num_layers=L, boundary_gib=draw(st.sampled_from([0.25, 1.0])),
        layer_param_gib=draw(st.sampled_from([0.1, 0.5, 1.5])),
        fwd_s=draw(st.sampled_from([0.02, 0.05, 0.2])),
        bwd_s=draw(st.sampled_from([0.04, 0.1, 0.4])),
        h2d_gbps=draw(st.sampled_from([4.0, 12.0, 40.0])),
        d2h_gbps=draw(st.sampled_from([4.0, 12.0, 40.0])),
        nvme_read_gbps=draw(st.sampled_from([1.0, 3.0])),
        nvme_write_gbps=draw(st.sampled_from([1.0, 3.0])))
    nvme = draw(st.booleans())
    budgets = budgets_in_slots(
        model, hardware, gpu_slots=draw(st.integers(2, L + 2)),
        cpu_slots=draw(st.integers(0, L)),
        nvme_slots=draw(st.integers(1, L)) if nvme else 0, max_recompute_block=K)
    return model, hardware, budgets, K


def _plan(instance: tuple, strategy: str):
    model, hardware, budgets, K = instance
    try:
        return make_plan(model, hardware, strategy=strategy, budgets=budgets,
                         max_recompute_block=K, time_limit_s=20)
    except PlanInfeasibleError:
        return None


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(chains())
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
