"""`make_plan`: one strategy -> one `Plan` (the MIP, its GPU-only variant, or a baseline)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING

from lazytrain_accel.planning.baselines import BASELINES
from lazytrain_accel.planning.no_solver import FixedSolution, evaluate_fixed
from lazytrain_accel.planning.plan import Plan, SolverReport, run_fingerprint
from lazytrain_accel.planning.problem import (
    GIB,
    Budgets,
    PlanInfeasibleError,
    Problem,
    build_problem,
)
from lazytrain_accel.planning.schedule import blocks_of, predict, schedule_transfers
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile

if TYPE_CHECKING:
    from lazytrain_accel.planning.milp import MilpSolution

try:  # the only import of the solver; without it, baselines still plan (loudly)
    from lazytrain_accel.planning.milp import solve_milp
    NO_SOLVER_REASON = ""
except ImportError as err:
    solve_milp = None
    NO_SOLVER_REASON = f"PySCIPOpt cannot be imported ({err})"

log = logging.getLogger(__name__)

#: Re-solves allowed when the simulated device peak exceeds the budget.
MAX_STAGING_ROUNDS = 4

STRATEGIES: tuple[str, ...] = ("lazytrain", "megatrain", "checkpoint_all", "offload_all",
                               "lazytrain_gpu_only")


def _gib(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps three significant digits visible."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def infeasible_error(p: Problem, strategy: str, solution: MilpSolution) -> PlanInfeasibleError:
    """The error naming each binding tier, its shortfall and its fixed use."""
    b = p.budgets
    fixed = {"gpu": (b.gpu_bytes, p.gpu_fixed_bytes, "--gpu-memory-gb"),
             "cpu": (b.cpu_bytes, p.static_cpu_bytes, "--cpu-memory-gb"),
             "nvme": (b.nvme_bytes, 0, "--nvme-gb")}
    parts = [f"{tier.upper()} short by {_gib(short)} (needs {_gib(fixed[tier][0] + short)}, "
             f"budget {_gib(fixed[tier][0])}, base {_gib(fixed[tier][1])} before activations)"
             for tier, short in solution.shortfall_bytes.items()]
    flags = " / ".join(fixed[tier][2] for tier in solution.shortfall_bytes) or "the budgets"
    detail = "; ".join(parts) or "no tier named (solver limit reached while diagnosing)"
    return PlanInfeasibleError(
        f"no {strategy} plan fits {p.num_layers} layers with {_gib(p.boundary_bytes)} per "
        f"boundary: {detail}. Raise {flags}, lower --batch-size or --seq-len, or pick a "
        "strategy that recomputes or offloads more.", dict(solution.shortfall_bytes))


def _diagnose(p: Problem, strategy: str, time_limit_s: float,
              **kwargs: object) -> PlanInfeasibleError:
    elastic = solve_milp(p, time_limit_s=time_limit_s, gap=0.0, elastic=True, **kwargs)
    return infeasible_error(p, strategy, elastic)


def _baseline_solution(p: Problem, strategy: str, time_limit_s: float) -> MilpSolution:
    homes = BASELINES[strategy](p)
    solution = solve_milp(p, time_limit_s=time_limit_s, gap=0.0, fixed_homes=homes)
    if solution.homes is None:
        raise _diagnose(p, strategy, time_limit_s, fixed_homes=homes)
    solution.status = "baseline"
    return solution


def _fallback(p: Problem, time_limit_s: float, why: str) -> FixedSolution:
    """The fastest baseline that fits, when the MIP found no plan in time. Baselines are
    priced without the solver: a time-limited solve of them could run dry as well."""
    return _loud_fallback(p, f"MIP found no plan ({why}) within {time_limit_s:g} s",
                          "Raise the time limit (solver_time_limit_s, --time-limit-s)")


def _loud_fallback(p: Problem, why: str, remedy: str) -> FixedSolution:
    results = {name: evaluate_fixed(p, BASELINES[name](p)) for name in BASELINES}
    feasible = {n: r for n, r in results.items() if not r.shortfall_bytes}
    if not feasible:  # name the tiers of the baseline closest to fitting
        closest = min(results.values(), key=lambda r: sum(r.shortfall_bytes.values()))
        err = infeasible_error(p, "baseline", closest)
        raise PlanInfeasibleError(f"{why}, and {err} {remedy}.", err.shortfall_bytes)
    name = min(feasible, key=lambda n: feasible[n].objective_s)
    best = feasible[name]
    best.status = "fallback"
    best.message = f"{why}; FALLING BACK to the {name} baseline. {remedy} to get a LazyTrain plan."
    warnings.warn(best.message, RuntimeWarning, stacklevel=4)
    log.warning(best.message)
    return best


def solve_problem(p: Problem, *, strategy: str, time_limit_s: float,
                  gap: float = 0.01) -> MilpSolution:
    """The solution of `strategy` on `p`; raises `PlanInfeasibleError` when none fits."""
    if solve_milp is None:
        return _without_solver(p, strategy)
    if strategy in BASELINES:
        return _baseline_solution(p, strategy, time_limit_s)
    if strategy not in ("lazytrain", "lazytrain_gpu_only"):
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    offload = strategy == "lazytrain"
    solution = solve_milp(p, time_limit_s=time_limit_s, gap=gap, allow_cpu=offload,
                          allow_nvme=offload)
    if solution.homes is not None:
        if solution.status not in ("optimal", "gaplimit"):  # a limit hit: the incumbent
            solution.message = (f"MIP stopped ({solution.status}) after "
                                f"{solution.solve_s:.1f} s; using the best plan found, "
                                f"within {solution.gap:.2%} of the best possible step")
            log.warning("lazytrain: %s", solution.message)
        return solution
    if solution.status == "infeasible":
        raise _diagnose(p, strategy, time_limit_s, allow_cpu=offload, allow_nvme=offload)
    return _fallback(p, time_limit_s, solution.status)


def _without_solver(p: Problem, strategy: str) -> FixedSolution:
    """`strategy` if it is a baseline, else the fastest baseline that fits, with a warning."""
    if strategy not in BASELINES:
        return _loud_fallback(p, NO_SOLVER_REASON,
                              "Install PySCIPOpt (pip install PySCIPOpt)")
    solution = evaluate_fixed(p, BASELINES[strategy](p))
    if solution.shortfall_bytes:
        raise infeasible_error(p, strategy, solution)
    return solution


def plan_from_solution(p: Problem, solution: MilpSolution, *, strategy: str,
                       model: ModelProfile, hardware: HardwareProfile) -> Plan:
    assert solution.homes is not None
    transfers = schedule_transfers(p, solution.homes, solution.exposed_s)
    prediction = predict(p, solution.homes, transfers)
    report = SolverReport(status=solution.status, solve_s=solution.solve_s, gap=solution.gap,
                          objective_s=solution.objective_s,
                          message=solution.message)
    return Plan(strategy=strategy, num_layers=p.num_layers, batch_size=model.batch_size,
                seq_len=model.seq_len, boundary_bytes=p.boundary_bytes,
                homes=list(solution.homes), blocks=blocks_of(solution.homes),
                transfers=transfers, prediction=prediction, solver=report,
                fingerprint=run_fingerprint(model, hardware))


def make_plan(model: ModelProfile, hardware: HardwareProfile, *, strategy: str = "lazytrain",
              budgets: Budgets | None = None, max_recompute_block: int = 8,
              time_limit_s: float = 60.0, gap: float = 0.01) -> Plan:
    """The plan of `strategy` for `model` on `hardware` within `budgets` (default: the
    hardware's capacities). Raises `PlanInfeasibleError` naming the binding tiers.

    Every plan is run once in the simulator: when saturated links keep more offloaded
    boundaries in flight on the device than the staging allowance, the allowance grows by
    the overflow and the plan is solved again, so no plan's simulated peak exceeds a budget.
    """
    p = build_problem(model, hardware, budgets=budgets, max_recompute_block=max_recompute_block)
    for _ in range(MAX_STAGING_ROUNDS):
        solution = solve_problem(p, strategy=strategy, time_limit_s=time_limit_s, gap=gap)
        plan = plan_from_solution(p, solution, strategy=strategy, model=model,
                                  hardware=hardware)
        overflow_bytes = simulate(plan, model, hardware).peak_gpu_bytes - p.budgets.gpu_bytes
        if overflow_bytes <= 0:
            return plan
        extra = -(-overflow_bytes // p.boundary_bytes)
        p = dataclasses.replace(p, staging_boundaries=p.staging_boundaries + extra)
    raise PlanInfeasibleError(
        f"the {strategy} plan keeps overflowing the GPU budget in simulation (offloaded "
        f"boundaries in flight exceed {p.staging_boundaries} staging slots); raise "
        "--gpu-memory-gb or lower --batch-size", {"gpu": int(overflow_bytes)})

