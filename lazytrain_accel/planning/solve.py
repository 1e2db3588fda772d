"""`make_plan`: one strategy -> one `Plan` (the MIP, its GPU-only variant, or a baseline).

Every plan is run once in the event simulator and carries the simulated figures as its
prediction, so `lazytrain plan` and `lazytrain simulate` print the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence

from lazytrain_accel.config import STRATEGIES
from lazytrain_accel.planning.baselines import BASELINES, GPU_ONLY_BASELINES
from lazytrain_accel.planning.fastest import fastest, repriced
from lazytrain_accel.planning.loss_head import plan_loss_head
from lazytrain_accel.planning.no_solver import admissible, evaluate_fixed
from lazytrain_accel.planning.node import resolve_node_layout
from lazytrain_accel.planning.plan import (
    STATE_PARTS,
    Home,
    Plan,
    Prediction,
    Solution,
    StateHomes,
    tiling_of,
)
from lazytrain_accel.planning.problem import (
    Budgets,
    PlanInfeasibleError,
    Problem,
    build_problem,
    with_state_homes,
)
from lazytrain_accel.planning.refusal import infeasible_error
from lazytrain_accel.planning.request import (
    DIAGNOSE_TIME_LIMIT_S,
    NODE_STATE_PARTS,
    RESTRICTED_PARTS,
    PlanRequest,
)
from lazytrain_accel.planning.schedule import blocks_of, schedule_transfers
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.planning.state_search import needs_state_homes, state_candidates
from lazytrain_accel.planning.tiles import plan_tiles
from lazytrain_accel.profiling.fingerprint import run_fingerprint
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile

try:  # the only import of the solver; without it, baselines still plan (loudly)
    from lazytrain_accel.planning.milp import solve_milp
    NO_SOLVER_REASON = ""
except ImportError as err:
    solve_milp = None
    NO_SOLVER_REASON = f"PySCIPOpt cannot be imported ({err})"

log = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "PlanRequest", "make_plan", "solve_problem"]

#: The MIP that decides the host state's homes starts from the best candidate and stops
#: at this limit or gap: its layers' binaries are near-symmetric, so proving the last
#: fraction of a percent took SCIP past 60 s at 70B, for steps within 2% of the incumbent
#: (docs/benchmarks.md "Host state on NVMe").
STATE_TIME_LIMIT_S = 10.0
STATE_GAP = 0.005

#: Re-solves allowed when a simulated peak exceeds its budget (saturated links keep more
#: boundaries in flight than the staging allowance).
MAX_STAGING_ROUNDS = 4


def _diagnose(p: Problem, strategy: str, time_limit_s: float, names: tuple[str, ...],
              **kwargs: object) -> PlanInfeasibleError:
    """The refusal: the least total shortfall over the strategy's plans (with more
    budget by that much, a plan fits). `time_limit_s` = 0: the closest baseline's
    shortfall, without a solve (admission probes, whose reason nobody reads)."""
    closest = min((evaluate_fixed(p, BASELINES[n](p)) for n in names
                   if admissible(p, BASELINES[n](p))),
                  key=lambda r: sum(r.shortfall_bytes.values()), default=None)
    if time_limit_s <= 0 and closest is not None:
        return infeasible_error(p, strategy, closest.shortfall_bytes)
    start = None if closest is None or "fixed_homes" in kwargs else closest.homes
    elastic = solve_milp(p, time_limit_s=max(time_limit_s, 0.5), gap=0.0, elastic=True,
                         start_homes=start, **kwargs)
    return infeasible_error(p, strategy, elastic.shortfall_bytes)


def _best_fixed(p: Problem, names: tuple[str, ...], running: Sequence[Home] | None = None
                ) -> tuple[str, Solution] | None:
    """The fastest of the named baselines (and the `running` plan's homes) that fits,
    priced without the solver."""
    fits = []
    candidates = [(name, BASELINES[name](p)) for name in names]
    if running is not None and len(running) == p.num_layers + 1:
        candidates.append(("running", list(running)))
    for name, homes in candidates:
        if not admissible(p, homes):
            continue
        solution = evaluate_fixed(p, homes)
        if solution.feasible:
            fits.append((solution.objective_s, name, solution))
    return min(fits, key=lambda f: f[0])[1:] if fits else None


def _baseline_solution(p: Problem, strategy: str, time_limit_s: float,
                       diagnose_s: float) -> Solution:
    homes = BASELINES[strategy](p)
    if solve_milp is None:
        solution = evaluate_fixed(p, homes)
        if solution.shortfall_bytes:
            raise infeasible_error(p, strategy, solution.shortfall_bytes)
        return solution
    solution = solve_milp(p, time_limit_s=time_limit_s, gap=0.0, fixed_homes=homes)
    if solution.homes is None:
        raise _diagnose(p, strategy, diagnose_s, (strategy,), fixed_homes=homes)
    return dataclasses.replace(solution, status="baseline")


def _fallback(p: Problem, names: tuple[str, ...], why: str, remedy: str) -> Solution:
    """The fastest baseline that fits, loudly; a refusal naming the tiers when none does."""
    best = _best_fixed(p, names)
    if best is None:
        closest = min((evaluate_fixed(p, BASELINES[n](p)) for n in names),
                      key=lambda r: sum(r.shortfall_bytes.values()))
        err = infeasible_error(p, "baseline", closest.shortfall_bytes)
        raise PlanInfeasibleError(f"{why}, and {err} {remedy}.", err.shortfall_bytes)
    name, solution = best
    message = f"{why}; FALLING BACK to the {name} baseline. {remedy} to get a LazyTrain plan."
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    log.warning(message)
    return dataclasses.replace(solution, status="fallback", message=message)


def solve_problem(p: Problem, *, strategy: str, time_limit_s: float, gap: float = 0.001,
                  diagnose_s: float = DIAGNOSE_TIME_LIMIT_S,
                  running: Sequence[Home] | None = None,
                  start: tuple[Sequence[Home], StateHomes] | None = None) -> Solution:
    """The solution of `strategy` on `p`; raises `PlanInfeasibleError` when none fits,
    naming the shortfall found within `diagnose_s` seconds. The MIP starts from the best
    of the baselines and the `running` plan's homes, as the MIP prices them, or from
    `start` (boundary homes and state homes: where the MIP decides the state)."""
    diagnose_s = min(diagnose_s, time_limit_s)
    if strategy in BASELINES:
        return _baseline_solution(p, strategy, time_limit_s, diagnose_s)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    offload = strategy == "lazytrain"
    names = tuple(BASELINES) if offload else GPU_ONLY_BASELINES
    if solve_milp is None:
        return _fallback(p, names, NO_SOLVER_REASON, "Install PySCIPOpt (pip install PySCIPOpt)")
    best = _best_fixed(p, names, running)  # the search starts from the best known plan
    start_homes, start_state = (start if start is not None
                                else (best[1].homes if best else None, None))
    solution = solve_milp(p, time_limit_s=time_limit_s, gap=gap, allow_cpu=offload,
                          allow_nvme=offload, start_homes=start_homes, start_state=start_state)
    if solution.homes is not None:
        if solution.status not in ("optimal", "gaplimit"):  # a limit hit: the incumbent
            message = (f"MIP stopped ({solution.status}) after {solution.solve_s:.1f} s; "
                       f"using the best plan found, within {solution.gap:.2%} of the best "
                       "possible step")
            log.warning("lazytrain: %s", message)
            solution = dataclasses.replace(solution, message=message)
        return solution
    if solution.status == "infeasible":
        raise _diagnose(p, strategy, diagnose_s, names, allow_cpu=offload,
                        allow_nvme=offload)
    return _fallback(p, names, f"MIP found no plan ({solution.status}) within "
                     f"{time_limit_s:g} s", "Raise the time limit (--time-limit-s, "
                     "solver_time_limit_s)")


def plan_from_solution(p: Problem, solution: Solution, *, strategy: str,
                       model: ModelProfile, hardware: HardwareProfile,
                       include_optimizer: bool = True) -> Plan:
    """The plan of `solution`, its prediction taken from one simulated step (with the
    host optimizer's overlapped update unless `include_optimizer=False`)."""
    if solution.homes is None:
        raise ValueError(f"solution has no homes (status {solution.status}): nothing to plan")
    if solution.state is not None:  # the MIP decided the state's homes: price them
        p = with_state_homes(dataclasses.replace(p, decide_state=False), solution.state)
    homes = list(solution.homes)
    tiling, tile_tokens = tiling_of(model.tile_tokens or 0, model.attention_block_tokens)
    draft = Plan(strategy=strategy, num_layers=p.num_layers, batch_size=model.batch_size,
                 seq_len=model.seq_len, boundary_bytes=p.boundary_bytes, homes=homes,
                 blocks=blocks_of(homes),
                 transfers=schedule_transfers(p, homes, solution.exposed_s),
                 prediction=Prediction(step_s=0.0, compute_s=0.0, recompute_s=0.0,
                                       exposed_s=0.0),
                 solver=solution, fingerprint=run_fingerprint(model, hardware),
                 loss_chunk_tokens=model.loss_chunk_tokens or 0,
                 tiling=tiling, tile_tokens=tile_tokens,
                 resident_update=p.resident_update, optimizer=p.optimizer,
                 gpus_per_node=p.gpus_per_node, nodes=p.nodes, node_layout=p.node_layout,
                 state=p.state)
    result = simulate(draft, model, hardware, include_optimizer=include_optimizer)
    return dataclasses.replace(draft, prediction=result.prediction())


def _overflow(p: Problem, plan: Plan) -> Problem | None:
    """`p` with more staging where the plan's simulated peaks exceed a budget."""
    pred, A = plan.prediction, p.boundary_bytes
    gpu_over = pred.peak_gpu_bytes - p.budgets.gpu_bytes
    cpu_over = pred.peak_cpu_bytes - p.budgets.cpu_bytes
    if gpu_over <= 0 and cpu_over <= 0:
        return None
    return dataclasses.replace(
        p, staging_boundaries=p.staging_boundaries + max(-(-gpu_over // A), 0),
        host_staging_boundaries=p.host_staging_boundaries + max(-(-cpu_over // A), 0))


def plan_problem(p: Problem, model: ModelProfile, hardware: HardwareProfile, *,
                 strategy: str, time_limit_s: float, gap: float,
                 include_optimizer: bool = True,
                 diagnose_s: float = DIAGNOSE_TIME_LIMIT_S,
                 running: Sequence[Home] | None = None,
                 start: tuple[Sequence[Home], StateHomes] | None = None) -> Plan:
    """Solve, simulate, and solve again with more staging while a simulated peak exceeds
    its budget, so no plan's simulated peak does."""
    for _ in range(MAX_STAGING_ROUNDS):
        solution = solve_problem(p, strategy=strategy, time_limit_s=time_limit_s, gap=gap,
                                 diagnose_s=diagnose_s, running=running, start=start)
        plan = plan_from_solution(p, solution, strategy=strategy, model=model,
                                  hardware=hardware, include_optimizer=include_optimizer)
        bigger = _overflow(p, plan)
        if bigger is None:
            return plan
        p = bigger
    pred = plan.prediction
    raise PlanInfeasibleError(
        f"the {strategy} plan keeps overflowing its budgets in simulation (boundaries in "
        f"flight exceed {p.staging_boundaries} device / {p.host_staging_boundaries} host "
        "staging slots): raise --gpu-memory-gb / --cpu-memory-gb, or plan a smaller "
        "micro-batch", {"gpu": max(pred.peak_gpu_bytes - p.budgets.gpu_bytes, 0),
                        "cpu": max(pred.peak_cpu_bytes - p.budgets.cpu_bytes, 0)})


def with_device_residents(plan: Plan, model: ModelProfile, hardware: HardwareProfile,
                          budgets: Budgets, *, only_if_faster: bool = True) -> Plan | None:
    """`plan` with the residents' masters, moments and update on the GPU, when its
    simulated peaks still fit `budgets` (the GPU's reserve kept) and (`only_if_faster`)
    its step is faster; else None. The homes stay: the device bytes come out of the
    plan's headroom."""
    if model.resident_trainable_param_count == 0 or plan.resident_update == "device":
        return None
    moved = dataclasses.replace(plan, resident_update="device")
    prediction = simulate(moved, model, hardware).prediction()
    if (prediction.peak_gpu_bytes + budgets.gpu_reserve_bytes > budgets.gpu_bytes
            or prediction.peak_cpu_bytes > budgets.cpu_bytes
            or (only_if_faster and prediction.step_s >= plan.prediction.step_s)):
        return None
    return dataclasses.replace(moved, prediction=prediction)


def make_plan(model: ModelProfile, hardware: HardwareProfile,
              request: PlanRequest | None = None) -> Plan:
    """The plan of `request.strategy` for `model` on `hardware` within `request.budgets`
    (default: the hardware's capacities; `request` default: `PlanRequest()`). Raises
    `PlanInfeasibleError` naming the binding tiers. The prediction is one simulated step,
    with the hybrid 8-bit host optimizer's overlapped update unless `include_optimizer` is
    False. A refusal's shortfall comes from an elastic re-solve of at most `diagnose_s`
    seconds (0: the closest baseline's, no solve).

    `model.loss_chunk_tokens=None` ("auto") lets the planner turn the fused chunked loss
    on where the full logits' working set would cost a budget or speed (`loss_head.py`);
    `model.tile_tokens=None` ("auto") lets it tile each layer's token-wise parts and run
    its attention in query blocks where the untiled working set would not fit (`tiles.py`).

    `resident_update` says where the residents' (embeddings, final norm, head) update
    runs: "host", "device" (their masters and 8-bit moments on the GPU, charged to its
    budget: `residents_on_device`), or "auto": on the GPU where the plan's homes leave
    room for them and the step gets faster (`with_device_residents`). The megatrain
    baseline keeps every update on the host, as MegaTrain does; so does a run without the
    hybrid 8-bit update
    (`include_optimizer=False`: a kept optimizer, its host state priced as AdamW's).

    `gpus_per_node` > 1 plans one rank of a node whose ranks share one host copy of the
    state (`node.py`): the budgets' host bytes are the node's, the links the rank's share.

    The result is never slower, as the simulator prices it, than a baseline of the
    strategy or `request.running` (a re-plan's running plan) that fits (`fastest.py`).
    Where the host state did not fit DRAM, its `solver.state_steps_s` holds each state
    candidate's simulated step, the fastest over the profiles planned (tiles, resident
    placements; `lazytrain plan` prints them): the step `host_state=` that candidate plans
    where that plans the same profiles (with `resident_update="device"`, a host-placed
    candidate is priced before `residents_on_device` moves its residents).
    """
    r = request or PlanRequest()
    host_only = r.strategy == "megatrain" or not r.include_optimizer
    forced = "host" if host_only or r.resident_update == "auto" else r.resident_update
    budgets = r.budgets or Budgets.from_hardware(hardware)
    optimizer = "hybrid8bit" if r.include_optimizer else "keep"
    running = None if r.running is None else tuple(r.running.homes)
    priced: list[Mapping[str, float | None]] = []  # each `plan_host_state`'s candidates

    def problem(profile: ModelProfile, resident_update: str) -> Problem:
        return build_problem(profile, hardware, budgets=budgets,
                             max_recompute_block=r.max_recompute_block,
                             resident_update=resident_update, optimizer=optimizer,
                             gpus_per_node=r.gpus_per_node, nodes=r.nodes,
                             node_layout=resolve_node_layout(r.node_layout, r.nodes))

    def solved(profile: ModelProfile, resident_update: str) -> Plan:
        p = problem(profile, resident_update)
        if not (r.include_optimizer and r.host_state != "dram" and needs_state_homes(p)):
            return solved_in(p, profile)
        plan = plan_host_state(p, profile, hardware, r, solved_in)
        priced.append(plan.solver.state_steps_s)
        return plan

    def solved_in(p: Problem, profile: ModelProfile) -> Plan:
        plan = plan_problem(p, profile, hardware, strategy=r.strategy,
                            time_limit_s=r.time_limit_s, gap=r.gap,
                            include_optimizer=r.include_optimizer, diagnose_s=r.diagnose_s,
                            running=running)
        others = [] if r.strategy in BASELINES else baseline_plans(
            p, profile, hardware, strategy=r.strategy, include_optimizer=r.include_optimizer)
        if r.resident_update == "auto" and not host_only and not p.state.any:
            # each candidate places its residents as "auto" does before they compete: the
            # MIP's pick may leave no room for them on the GPU where a baseline does
            def placed(candidate: Plan) -> Plan:
                return with_device_residents(candidate, profile, hardware, budgets) or candidate

            plan, others = placed(plan), [(name, placed(other)) for name, other in others]
        return fastest(plan, others, budgets)

    def plan_for(profile: ModelProfile) -> Plan:
        return (residents_on_device(profile, solved, hardware, budgets) if forced == "device"
                else solved(profile, forced))

    def plan_head(profile: ModelProfile) -> Plan:
        if profile.loss_chunk_tokens is None:
            return plan_loss_head(profile, hardware, plan_for, budgets=budgets,
                                  max_recompute_block=r.max_recompute_block,
                                  include_optimizer=r.include_optimizer)
        return plan_for(profile)

    if model.tile_tokens is None:
        plan = plan_tiles(model, hardware, plan_head, budgets=budgets,
                          max_recompute_block=r.max_recompute_block)
    else:
        plan = plan_head(model)
    kept = None if r.running is None or r.running.resident_update != plan.resident_update \
        else repriced(r.running, model, hardware, include_optimizer=r.include_optimizer)
    plan = plan if kept is None else fastest(plan, [("running", kept)], budgets)
    return _with_state_steps(plan, _fastest_steps(priced)) if priced else plan


def _with_state_steps(plan: Plan, steps_s: Mapping[str, float | None]) -> Plan:
    """`plan` with `steps_s` as its solver's state candidates' steps."""
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver,
                                                                state_steps_s=dict(steps_s)))


def _fastest_steps(priced: list[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Each state candidate's fastest step over `priced` (None where it never fit)."""
    names = dict.fromkeys(name for steps_s in priced for name in steps_s)
    return {name: min((s[name] for s in priced if s.get(name) is not None), default=None)
            for name in names}


def plan_host_state(p: Problem, model: ModelProfile, hardware: HardwareProfile,
                    r: PlanRequest, solved_in: Callable[[Problem, ModelProfile], Plan]) -> Plan:
    """The plan of `p`, whose host state does not fit DRAM (`needs_state_homes`): the
    fastest simulated of the state candidates each solved by `solved_in` (with the
    boundary baselines), and of the MIP deciding the state itself from the best of them
    (docs/planner.md "Host state on NVMe"); `r.host_state` may name one candidate. The
    plan's `solver.state_steps_s`: each candidate's simulated step, None where it did not
    fit. The refusal where none fits: short of DRAM even with every part that may on
    NVMe, or else the one with every part in DRAM."""
    recomputed = () if r.strategy not in BASELINES else tuple(
        j for j, home in enumerate(BASELINES[r.strategy](p)) if home == Home.RECOMPUTE)
    parts = RESTRICTED_PARTS.get(r.host_state)  # the planner chooses among these only
    chosen = "auto" if parts else r.host_state
    if p.gpus_per_node > 1:  # a node store's ranks: what they can home
        parts = tuple(part for part in parts or STATE_PARTS if part in NODE_STATE_PARTS)
        if not parts:
            return solved_in(p, model)
    if parts:
        p = dataclasses.replace(p, state_parts=parts)
    plans, refusal, steps_s = [], None, {}
    for name, homes in state_candidates(p, recomputed=recomputed):
        if chosen not in ("auto", name):
            continue
        try:
            plans.append(solved_in(with_state_homes(p, homes), model))
        except PlanInfeasibleError as err:  # the last: every part that may, on NVMe
            refusal, steps_s[name] = err, None
        else:
            steps_s[name] = plans[-1].prediction.step_s
    if plans and chosen == "auto" and r.strategy not in BASELINES \
            and solve_milp is not None:  # the MIP decides, from the best candidate
        best = min(plans, key=lambda plan: plan.prediction.step_s)
        with contextlib.suppress(PlanInfeasibleError):  # else the candidates stand
            plans.append(plan_problem(
                dataclasses.replace(p, decide_state=True), model, hardware,
                strategy=r.strategy, time_limit_s=min(r.time_limit_s, STATE_TIME_LIMIT_S),
                gap=max(r.gap, STATE_GAP), include_optimizer=r.include_optimizer,
                diagnose_s=r.diagnose_s, start=(best.homes, best.state)))
    if plans:
        return _with_state_steps(min(plans, key=lambda plan: plan.prediction.step_s), steps_s)
    if refusal is not None and set(refusal.shortfall_bytes) == {"cpu"}:
        raise refusal
    return solved_in(p, model)


def baseline_plans(p: Problem, model: ModelProfile, hardware: HardwareProfile, *,
                   strategy: str, include_optimizer: bool) -> list[tuple[str, Plan]]:
    """The baselines of `strategy` that fit `p` as the MIP counts capacity, each simulated
    (`fastest` keeps one only where its simulated peaks fit too)."""
    names = tuple(BASELINES) if strategy == "lazytrain" else GPU_ONLY_BASELINES
    plans = []
    for name in names:
        homes = BASELINES[name](p)
        solution = evaluate_fixed(p, homes) if admissible(p, homes) else None
        if solution is not None and solution.feasible:
            plans.append((name, plan_from_solution(
                p, dataclasses.replace(solution, status="baseline"), strategy=strategy,
                model=model, hardware=hardware, include_optimizer=include_optimizer)))
    return plans


def residents_on_device(profile: ModelProfile, solved: Callable[[ModelProfile, str], Plan],
                        hardware: HardwareProfile, budgets: Budgets) -> Plan:
    """The faster of two plans with the residents' update on the GPU: solved with their
    bytes charged to the GPU budget, and solved without them, then moved there where the
    homes leave room (what "auto" does). The first alone has fewer GPU slots for the
    boundaries and can be much slower (docs/planner.md "Where the residents' update
    runs")."""
    plans, refusal = [], None
    try:
        plans.append(solved(profile, "device"))
    except PlanInfeasibleError as err:
        refusal = err
    try:
        moved = with_device_residents(solved(profile, "host"), profile, hardware, budgets,
                                      only_if_faster=False)
    except PlanInfeasibleError:
        moved = None
    if moved is not None:
        plans.append(moved)
    if not plans:
        raise refusal
    return min(plans, key=lambda plan: plan.prediction.step_s)
