"""Solver faults: a time limit keeps the incumbent (gap logged); no PySCIPOpt at all gives
the best baseline plan with a warning, the same plan the solver would give that baseline."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import warnings

import pytest

from lazytrain_accel.planning import Budgets, build_problem, make_plan
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)

_WITHOUT_SCIP = textwrap.dedent("""
    import json, sys, warnings
    sys.modules["pyscipopt"] = None  # as on a machine where it is not installed
    from lazytrain_accel.planning import Budgets, PlanInfeasibleError, PlanRequest, make_plan
    from lazytrain_accel.profiling.hardware_spec import load_hardware
    from lazytrain_accel.profiling.model_configs import (geometry_from_config, load_model_config,
                                                  profile_model)
    hw = load_hardware("rtx3090")
    model = profile_model(geometry_from_config(load_model_config("qwen2.5-3b")),
                          batch_size=2, seq_len=1024)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = make_plan(model, hw, PlanRequest(strategy="lazytrain"))
    out["warnings"] = [str(w.message) for w in caught]
    out["lazytrain"] = [plan.solver.status, plan.solver.message, [h.value for h in plan.homes],
                        plan.prediction.step_s]
    plan = make_plan(model, hw, PlanRequest(strategy="megatrain"))
    out["megatrain"] = [plan.solver.status, [h.value for h in plan.homes]]
    try:
        budgets = Budgets.from_hardware(hw, gpu_memory_limit_gb=1)
        make_plan(model, hw, PlanRequest(budgets=budgets))
    except PlanInfeasibleError as err:
        out["infeasible"] = [str(err), sorted(err.shortfall_bytes)]
    print(json.dumps(out))
""")


def _profile(name: str, batch: int, seq: int):
    return profile_model(geometry_from_config(load_model_config(name)), batch_size=batch,
                         seq_len=seq)


def test_without_scip_the_best_baseline_plans_with_a_warning() -> None:
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_SCIP], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    status, message, homes, step_s = out["lazytrain"]
    assert status == "fallback" and "PySCIPOpt cannot be imported" in message
    assert any("FALLING BACK" in w for w in out["warnings"])
    # the baseline it fell back to, planned here with the solver, has the same homes
    hw, model = load_hardware("rtx3090"), _profile("qwen2.5-3b", 2, 1024)
    name = message.split("FALLING BACK to the ")[1].split(" ")[0]
    with_scip = make_plan(model, hw, PlanRequest(strategy=name))
    assert [h.value for h in with_scip.homes] == homes
    assert with_scip.prediction.step_s == pytest.approx(step_s, rel=0.05)
    assert out["megatrain"] == ["baseline", [h.value for h in make_plan(
        model, hw, PlanRequest(strategy="megatrain")).homes]]
    text, tiers = out["infeasible"]
    assert "gpu" in tiers and "GPU short by" in text


def test_time_limit_uses_the_incumbent_or_the_best_baseline_loudly(caplog) -> None:
    hw = load_hardware("h800")
    model = _profile("qwen3.6-27b", 16, 1024)
    budgets = Budgets.from_hardware(hw, gpu_memory_limit_gb=40, nvme_limit_gb=8)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = make_plan(model, hw, PlanRequest(budgets=budgets, max_recompute_block=64,
                                                time_limit_s=0.01))
    if plan.solver.status == "fallback":  # no incumbent in 0.01 s (the usual case here)
        assert "MIP found no plan (timelimit) within 0.01 s; FALLING BACK to the " \
               "offload_all baseline" in plan.solver.message
        assert any("FALLING BACK" in str(w.message) for w in caught)
        assert plan.homes == make_plan(model, hw, PlanRequest(budgets=budgets,
                                                              strategy="offload_all")).homes
    else:  # a fast machine found an incumbent: it is kept, with its gap logged
        assert plan.solver.status == "timelimit"
        assert f"within {plan.solver.gap:.2%}" in caplog.text
    assert plan.solver.message in caplog.text


def test_a_stopped_solve_keeps_its_incumbent_and_logs_the_gap(caplog, monkeypatch) -> None:
    # Deterministic stand-in for a time limit: SCIP stops at its first incumbent.
    from lazytrain_accel.planning import solve

    real = solve.solve_milp
    monkeypatch.setattr(solve, "solve_milp",
                        lambda *a, **kw: real(*a, **{**kw, "first_feasible": True}))
    hw = load_hardware("h800")
    model = _profile("qwen2.5-7b", 4, 1024)
    fixed = build_problem(model, hw).gpu_fixed_bytes  # room for ~8 of 29 boundaries
    budgets = Budgets(gpu_bytes=int((fixed + 8 * model.boundary_bytes) / 0.96),
                      cpu_bytes=hw.cpu_memory_bytes, nvme_bytes=hw.nvme_bytes)
    with caplog.at_level(logging.WARNING):
        plan = make_plan(model, hw, PlanRequest(budgets=budgets))
    assert plan.solver.status not in ("optimal", "gaplimit", "fallback")  # the incumbent
    assert plan.solver.message.startswith(f"MIP stopped ({plan.solver.status})")
    assert f"within {plan.solver.gap:.2%}" in plan.solver.message
    assert plan.solver.message in caplog.text
    monkeypatch.setattr(solve, "solve_milp", real)
    optimal = make_plan(model, hw, PlanRequest(budgets=budgets))
    # this incumbent is a feasible plan, never better than the optimum; its gap is the
    # distance to the bound proven when it stopped (the tight formulation's first
    # incumbent may already be optimal, unproven)
    assert plan.solver.gap > 0
    # (the prediction is the simulated step, which may execute the incumbent as fast)
    assert plan.solver.objective_s >= optimal.solver.objective_s * (1 - 1e-9)
    assert plan.prediction.step_s >= optimal.prediction.step_s
