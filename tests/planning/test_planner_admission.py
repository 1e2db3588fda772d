"""Batch admission and the fallback when the MIP finds nothing in time."""

from __future__ import annotations

import pytest
from planner_chains import chain

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan, max_batch_size
from lazytrain_accel.planning import solve as solve_module
from lazytrain_accel.planning.plan import Solution
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.simulate import simulate

GIB = 2**30


def _at(batch_size: int):
    return chain(num_layers=8, batch_size=batch_size, boundary_gib=0.25)[0]


def _fits(batch_size: int, hardware, budgets: Budgets, strategy: str) -> bool:
    try:
        make_plan(_at(batch_size), hardware, PlanRequest(strategy=strategy, budgets=budgets))
    except PlanInfeasibleError:
        return False
    return True


@pytest.mark.parametrize("strategy", ["lazytrain", "megatrain", "checkpoint_all"])
def test_max_batch_is_the_feasibility_edge(strategy: str) -> None:
    _, hardware = chain(num_layers=8)
    budgets = Budgets(gpu_bytes=12 * GIB, cpu_bytes=60 * GIB, nvme_bytes=0)
    best = max_batch_size(_at, hardware, PlanRequest(strategy=strategy, budgets=budgets), limit=512)
    assert _fits(best, hardware, budgets, strategy)
    assert not _fits(best + 1, hardware, budgets, strategy)


def test_offload_admits_more_than_megatrain() -> None:
    _, hardware = chain(num_layers=8)
    budgets = Budgets(gpu_bytes=12 * GIB, cpu_bytes=60 * GIB, nvme_bytes=0)
    mega = max_batch_size(_at, hardware, PlanRequest(strategy="megatrain", budgets=budgets))
    lazy = max_batch_size(_at, hardware, PlanRequest(strategy="lazytrain", budgets=budgets))
    assert lazy > mega


def test_nothing_fits_names_the_tier() -> None:
    _, hardware = chain(num_layers=8)
    budgets = Budgets(gpu_bytes=2 * GIB, cpu_bytes=60 * GIB, nvme_bytes=0)
    with pytest.raises(PlanInfeasibleError) as err:
        max_batch_size(_at, hardware, PlanRequest(budgets=budgets))
    assert "gpu" in err.value.shortfall_bytes


def test_no_incumbent_falls_back_to_best_baseline_loudly(monkeypatch) -> None:
    model, hardware = chain(num_layers=8)
    real = solve_module.solve_milp

    def timed_out(p, **kwargs) -> Solution:
        if kwargs.get("fixed_homes") is None and not kwargs.get("elastic"):
            return Solution(status="timelimit", homes=None, gap=float("inf"))
        return real(p, **kwargs)

    monkeypatch.setattr(solve_module, "solve_milp", timed_out)
    with pytest.warns(RuntimeWarning, match="FALLING BACK"):
        plan = make_plan(model, hardware, PlanRequest(time_limit_s=1.0))
    assert plan.solver.status == "fallback" and "baseline" in plan.solver.message
    baselines = [make_plan(model, hardware, PlanRequest(strategy=s)) for s in
                 ("megatrain", "checkpoint_all", "offload_all")]
    assert plan.prediction.step_s == pytest.approx(min(b.prediction.step_s for b in baselines))


def test_host_optimizer_exposure_only_when_slower_than_forward() -> None:
    model, hardware = chain(num_layers=8)
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all"))
    fast = simulate(plan, model, hardware, include_optimizer=True)
    assert fast.optimizer_exposed_s >= 0.0
    slow_hw = type(hardware)(**{**hardware.to_dict(), "cpu_optimizer_params_per_s": 1e6})
    slow = simulate(plan, model, slow_hw, include_optimizer=True)
    params = model.geometry.layer_param_count
    assert slow.optimizer_exposed_s >= 8 * params / 1e6 - 8 * 0.05 - 1e-6
    assert slow.step_s == pytest.approx(fast.step_s - fast.optimizer_exposed_s
                                        + slow.optimizer_exposed_s)
