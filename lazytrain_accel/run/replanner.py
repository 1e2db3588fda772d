"""`Replanner`: the plan follows the machine it runs on (`replan="auto"`).

At each optimizer-step boundary (`on_step`) it takes the step's measurements from the
engine's run totals (after `warmup_steps`) and keeps each rate's median, with a calibrated
profile once they settle (`profiling/calibration.py`). When a median drifts more than
`drift_factor` from the plan's, it solves on a background thread, from the running plan.
It switches (`RunState.adopt`) only when the new plan is predicted `min_gain` faster,
fits, and no rate still moving could undo that, at most once per
`min_steps_between_switches`; `GUARD_STEPS` after a switch it goes back when the new plan
measured `min_gain` slower. A plan changes where boundaries live, never the math.
Docs: docs/planner.md "Re-planning".
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from lazytrain_accel.engine.stats import StepStats
from lazytrain_accel.planning import Budgets, Plan, PlanInfeasibleError
from lazytrain_accel.planning.plan import Prediction
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.profiling.calibration import (
    RATE_FIELDS,
    RateEstimate,
    StepOverheadFit,
    StepSample,
    calibrate,
    drifts,
    format_rate,
    ratio,
    step_rates,
    with_step_overhead,
)
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.run.setup import PreparedRun

if TYPE_CHECKING:
    from lazytrain_accel.config import LazyTrainConfig
    from lazytrain_accel.profiling.profile import ModelProfile

logger = logging.getLogger("lazytrain_accel")

#: Steps measured before any rate is trusted.
WARMUP_STEPS = 3
#: Switches are at least this many steps apart.
MIN_STEPS_BETWEEN_SWITCHES = 20
#: A solve starts when a measured rate is this factor off the plan's. A smaller drift is
#: within what the rates of a busy machine swing by and seldom moves the best plan by
#: `replan_min_gain`; each solve takes a core from training. The 20x drifts of a wrong
#: preset or a contended NVMe are far beyond it. Figures: docs/benchmarks.md "Re-planning".
DRIFT_FACTOR = 1.5
#: Steps a new plan runs before its measured step is compared with the old plan's.
GUARD_STEPS = 3
#: The plan's own prediction this far off the first calibrated steps is explained in a line.
FIRST_PREDICTION_TOLERANCE = 0.25


class ReplannedEngine(Protocol):
    """What the re-planner needs of the engine (`StreamingEngine`): its run totals."""

    def total_stats(self) -> StepStats: ...


class CurrentRun(Protocol):
    """Where the run's current plan lives (`RunState`): the re-planner reads `run` at
    every use and hands a new one to `adopt`, which also sets the engine's plan."""

    @property
    def run(self) -> PreparedRun: ...

    def adopt(self, run: PreparedRun) -> None: ...


class Replanner:
    def __init__(self, *, engine: ReplannedEngine, state: CurrentRun, budgets: Budgets,
                 solve: Callable[[PreparedRun], Plan], min_gain: float,
                 include_optimizer: bool,
                 save_profile: Callable[[HardwareProfile], None] | None = None,
                 warmup_steps: int = WARMUP_STEPS,
                 min_steps_between_switches: int = MIN_STEPS_BETWEEN_SWITCHES,
                 drift_factor: float = DRIFT_FACTOR,
                 estimate: RateEstimate | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`solve(run)` makes a plan for `run.model_profile` on `run.hardware`; `state`
        holds the current run (`state.adopt` takes a switch); `save_profile` keeps a
        calibrated profile; `clock` times the steps (seconds)."""
        self._engine, self._state, self._budgets = engine, state, budgets
        self._solve, self._save = solve, save_profile
        self.min_gain, self._include_optimizer = min_gain, include_optimizer
        self.warmup_steps = warmup_steps
        self.min_steps_between_switches = min_steps_between_switches
        if not drift_factor > 1:
            raise ValueError(f"drift_factor={drift_factor} must be > 1 (a rate this factor "
                             "off the plan's starts a solve)")
        self.drift_factor = drift_factor
        self.estimate, self._clock = estimate or RateEstimate(), clock
        self.overhead_fit = StepOverheadFit(window_steps=self.estimate.window_steps)
        self.steps = 0  # step boundaries seen
        self.switches: list[int] = []  # the steps at which a new plan took over
        self.reverts: list[int] = []  # the steps at which the guard went back (step 5)
        self.calibrated: HardwareProfile | None = None  # the latest settled profile
        self.step_s: list[float] = []  # wall seconds between boundaries, per step
        self._last: tuple[float, StepStats] | None = None
        self._solved_on: HardwareProfile | None = None  # the profile of the latest solve
        self._pending: Future[Plan] | None = None
        self._pending_on: tuple[HardwareProfile, Plan, list[str]] | None = None
        # A solved plan waiting for its rates to settle: (the profile it was solved on, the
        # plan, the plan running then, the rates that drifted).
        self._candidate: tuple[HardwareProfile, Plan, Plan, list[str]] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._predicted: tuple[HardwareProfile, Plan, Prediction] | None = None
        # After a switch: (the median step before it, the run it replaced, the plan taken).
        self._guard: tuple[float, PreparedRun, Plan] | None = None

    @property
    def run(self) -> PreparedRun:
        """The run's current plan and the profiles it was made from (`state.run`)."""
        return self._state.run

    # ---- the step boundary -----------------------------------------------------------
    def on_step(self) -> None:
        """One optimizer step ended (skipped ones too): measure, maybe solve or switch."""
        now_s, totals = self._clock(), self._engine.total_stats()
        last, self._last = self._last, (now_s, totals)
        self.steps += 1
        if last is not None:
            self.step_s.append(now_s - last[0])
        if self.steps <= self.warmup_steps:
            return
        self.estimate.add(step_rates(self._sample(last[1] if last else StepStats(), totals)))
        if self._guard is not None and self.steps - self.switches[-1] >= GUARD_STEPS:
            self._judge_switch()
        measured = self._with_fitted_overhead(calibrate(
            self.run.hardware, self.estimate.medians(),
            where="the engine's measurements of this run"))
        if self.estimate.settled() and self.overhead_fit.full():
            if self.calibrated is None:
                self._explain_first_prediction(measured)
            self.calibrated = measured
        if self._pending is not None:
            if not self._pending.done():
                return
            self._collect_solve()
        if self._candidate is not None:
            self._consider_candidate(measured)
            return
        drifted = self._drifted_from(self._solved_on or self.run.hardware, measured)
        if self._too_soon() or not drifted:
            return
        # Solved at once, on the medians so far: a 20x drift shows in one step, and the
        # solve (seconds) runs while the estimate settles; the switch waits for that.
        if self._save is not None and self.estimate.settled(drifted):
            self._save(measured)
        logger.debug("lazytrain: step %d: %s drifted from the plan's rates (%s); solving "
                     "for them", self.steps, ", ".join(drifted), measured.source)
        self._start_solve(measured, drifted)

    def _with_fitted_overhead(self, measured: HardwareProfile) -> HardwareProfile:
        """`measured` with the step overhead fitted to this step and the ones before: the
        step's wall seconds less the running plan's simulated step at `measured`'s rates
        without the term."""
        if not self.step_s:
            return measured
        bare = replace(measured, step_overhead_s=0.0)
        modeled_s = self._step_on(self.run.plan, bare)
        self.overhead_fit.add(self.step_s[-1], modeled_s)
        logger.debug("lazytrain: step %d: measured %.4f s, simulated %.4f s without the step "
                     "overhead", self.steps, self.step_s[-1], modeled_s)
        return with_step_overhead(measured, self.overhead_fit.step_overhead_s())

    def _sample(self, before: StepStats, after: StepStats) -> StepSample:
        model = self.run.model_profile
        runs = {k: getattr(after, k) - getattr(before, k)
                for k in ("layer_forwards", "layer_recomputes", "layer_backwards")}
        flops = ((runs["layer_forwards"] + runs["layer_recomputes"] + runs["layer_backwards"])
                 * model.layer_fwd_flops + runs["layer_backwards"] * model.layer_bwd_flops)
        updated = model.trainable_param_count - (
            model.resident_trainable_param_count if self.run.plan.resident_update
            == "device" else 0)
        return StepSample(
            transfer_s={k: v - before.transfer_s[k] for k, v in after.transfer_s.items()},
            transfer_bytes={k: v - before.transfer_bytes[k]
                            for k, v in after.transfer_bytes.items()},
            layer_compute_s=(after.compute_s + after.recompute_s
                             - before.compute_s - before.recompute_s),
            layer_flops=flops, optimizer_update_s=after.optimizer_update_s
            - before.optimizer_update_s, updated_param_count=updated,
            host_work_s={k: v - before.host_work_s[k] for k, v in after.host_work_s.items()},
            host_work_bytes={k: v - before.host_work_bytes[k]
                             for k, v in after.host_work_bytes.items()})

    def _too_soon(self) -> bool:
        changes = self.switches + self.reverts
        return bool(changes) and (self.steps - max(changes) < self.min_steps_between_switches)

    def _drifted_from(self, planned: HardwareProfile, measured: HardwareProfile) -> list[str]:
        """The measured rates more than `drift_factor` off `planned`'s."""
        medians = self.estimate.medians()
        return [name for name, old, new in drifts(planned, measured)
                if name in medians and ratio(new, old) > self.drift_factor]

    # ---- the solve and the switch ----------------------------------------------------
    def _start_solve(self, hardware: HardwareProfile, drifted: list[str]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="lazytrain-replan")
        run = replace(self.run, hardware=hardware)
        self._pending_on = (hardware, self.run.plan, drifted)
        self._pending = self._executor.submit(self._solve, run)

    def _collect_solve(self) -> None:
        """The background solve ended: its plan waits as the candidate (`_consider_candidate`)."""
        future, self._pending = self._pending, None
        hardware, was_running, drifted = self._pending_on
        try:
            plan = future.result()
        except PlanInfeasibleError as err:
            self._solved_on = hardware
            logger.warning("lazytrain: no plan fits at the measured rates (%s); keeping the "
                           "running plan", err)
            return
        self._candidate = (hardware, plan, was_running, drifted)

    def _consider_candidate(self, measured: HardwareProfile) -> None:
        """Judge the solved plan on the medians now: switch when it is predicted `min_gain`
        faster than the running one whatever the rates still moving turn out to be (priced
        with them at their medians and at the values the plan assumed), keep the running
        plan when it is not (a rate drifting from the profile of that solve solves again),
        and wait while the answer depends on a rate still moving."""
        hardware, plan, was_running, drifted = self._candidate
        if self.run.plan is not was_running:
            self._candidate = None  # the run re-planned meanwhile (a longer batch): stale
            return
        if self._too_soon():
            return
        planned = self._solved_on or self.run.hardware  # what the drift was measured from
        moving = [name for name in drifted if not self._firm(name, planned)
                  and name in self._drifted_from(planned, measured)]
        profiles = [measured]
        if moving:  # the moving rates at the values the running plan assumed
            profiles.append(replace(measured, **{RATE_FIELDS[name]: getattr(
                planned, RATE_FIELDS[name]) for name in moving}))
        priced = [(self._step_on(was_running, p), self._step_on(plan, p)) for p in profiles]
        old_s, new_s = priced[0]
        unproven = (plan.solver.status not in ("optimal", "gaplimit")
                    and plan.solver.gap > self.min_gain)  # the incumbent of a limit hit
        faster = all(new <= (1 - self.min_gain) * old for old, new in priced)
        if not faster and moving:
            return  # the estimates still move: no decision yet
        self._candidate = None
        if not faster or not self._fits(plan) or unproven:
            self._solved_on = hardware
            logger.debug("lazytrain: step %d: the plan for the measured rates predicts %.3f "
                         "s, the running one %.3f s (fits the budgets: %s; solved in %.2f s, "
                         "%s, gap %.1f%%); keeping it", self.steps, new_s, old_s,
                         self._fits(plan), plan.solver.solve_s, plan.solver.status,
                         100 * plan.solver.gap)
            return
        self._solved_on = measured
        if self._save is not None:
            self._save(measured)
        self._guard = (statistics.median(self.step_s[-GUARD_STEPS:]), self.run, plan)
        planned_on = self.run.hardware
        self._state.adopt(replace(self.run, hardware=measured, plan=plan))
        self.switches.append(self.steps)
        named = self._drifted_from(planned_on, measured) or drifted
        rates = "; ".join(f"the measured {format_rate(name, new)}, the plan assumed "
                          f"{format_rate(name, old)}" for name, old, new
                          in drifts(planned_on, measured) if name in named)
        logger.info("lazytrain: re-planned at step %d: %s; predicted step at the measured "
                    "rates %.3f s with the new plan, %.3f s with the old one", self.steps,
                    rates, new_s, old_s)

    def _firm(self, name: str, reference: HardwareProfile) -> bool:
        """Whether `name`'s drift from `reference` is no longer in doubt: its median has
        settled, or every step of a full window measured it more than `drift_factor` off
        `reference`'s rate, on the same side."""
        if self.estimate.settled([name]):
            return True
        values, ref = self.estimate.recent(name), getattr(reference, RATE_FIELDS[name])
        return (len(values) == self.estimate.window_steps
                and (all(v > self.drift_factor * ref for v in values)
                     or all(v * self.drift_factor < ref for v in values)))

    def _judge_switch(self) -> None:
        """Back to the plan before the latest switch when the new one measured more than
        `min_gain` slower over its first `GUARD_STEPS` steps."""
        before_s, old_run, taken = self._guard
        self._guard = None
        after_s = statistics.median(self.step_s[-GUARD_STEPS:])
        if after_s <= (1 + self.min_gain) * before_s or self.run.plan is not taken:
            return  # faster, or the run re-planned meanwhile (a longer batch): keep it
        self._state.adopt(old_run)
        self.reverts.append(self.steps)
        logger.warning("lazytrain: step %d: the plan taken at step %d measured %.3f s a step, "
                       "%.3f s before it; back to the earlier plan (the simulator mispriced "
                       "the new one on this machine: please report it with `lazytrain "
                       "profile`)", self.steps, self.switches[-1], after_s, before_s)

    def _fits(self, plan: Plan) -> bool:
        """The simulated peaks within the budgets (as `make_plan` checks them)."""
        p, b = plan.prediction, self._budgets
        return (p.peak_gpu_bytes <= b.gpu_bytes and p.peak_cpu_bytes <= b.cpu_bytes
                and p.peak_nvme_bytes <= b.nvme_bytes)

    def _step_on(self, plan: Plan, hardware: HardwareProfile) -> float:
        return simulate(plan, self.run.model_profile, hardware,
                        include_optimizer=self._include_optimizer).step_s

    def _explain_first_prediction(self, measured: HardwareProfile) -> None:
        """The first settled calibration: where the plan's own prediction was more than
        `FIRST_PREDICTION_TOLERANCE` off the measured steps, say in one line which rate
        (or the step's fitted overhead) it was off by most: the one that, put alone into
        the planned profile, prices the running plan closest to the measured step."""
        plan, planned = self.run.plan, self.run.hardware
        measured_s = statistics.median(self.step_s[-self.estimate.window_steps:])
        if abs(measured_s / plan.prediction.step_s - 1) <= FIRST_PREDICTION_TOLERANCE:
            return
        names = [n for n in RATE_FIELDS if getattr(planned, RATE_FIELDS[n]) > 0
                 and getattr(measured, RATE_FIELDS[n]) > 0] + ["step overhead"]
        fields = {**RATE_FIELDS, "step overhead": "step_overhead_s"}

        def error_s(name: str) -> float:
            alone = replace(planned, **{fields[name]: getattr(measured, fields[name])})
            return abs(self._step_on(plan, alone) - measured_s)

        name = min(names, key=error_s)
        if name == "step overhead":
            was = (f"the step's overhead outside its priced work: the profile said "
                   f"{planned.step_overhead_s * 1e3:.3g} ms, this run fits "
                   f"{measured.step_overhead_s * 1e3:.3g} ms")
        else:
            was = (f"the {format_rate(name, getattr(planned, fields[name]))} the plan assumed; "
                   f"this run measures {format_rate(name, getattr(measured, fields[name]))}")
        logger.warning("lazytrain: the plan's prediction (%.3f s a step) was %.2fx off the "
                       "measured %.3f s, most of it from %s; predictions from here on use the "
                       "measured rates", plan.prediction.step_s,
                       measured_s / plan.prediction.step_s, measured_s, was)

    # ---- what a progress line shows --------------------------------------------------
    @property
    def predicted_step_s(self) -> float:
        """The running plan's step: on the calibrated profile once there is one, else its
        own prediction."""
        return self.prediction.step_s

    @property
    def prediction(self) -> Prediction:
        """The running plan's prediction: on the calibrated profile once there is one,
        else its own (what the fidelity monitor compares the measured steps with)."""
        plan, hardware = self.run.plan, self.calibrated
        if hardware is None:
            return plan.prediction
        if (self._predicted is None or self._predicted[0] is not hardware
                or self._predicted[1] is not plan):
            self._predicted = (hardware, plan, simulate(
                plan, self.run.model_profile, hardware,
                include_optimizer=self._include_optimizer).prediction())
        return self._predicted[2]

    def close(self) -> None:
        """Let a running solve end on its own (bounded by the solver's time limit)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def predicted_step_s(replanner: Predicting | None, plan: Plan) -> float:
    """The step a progress line prints beside the measured one: the running plan's at the
    calibrated rates once `replanner` has them, else the plan's own prediction."""
    return current_prediction(replanner, plan).step_s


class Predicting(Protocol):
    """A re-planner as the progress lines read it (`Replanner`, `LaunchReplanner`)."""

    @property
    def prediction(self) -> Prediction: ...


def current_prediction(replanner: Predicting | None, plan: Plan) -> Prediction:
    """The running `plan`'s prediction at the calibrated rates once `replanner` has them,
    else the plan's own."""
    return plan.prediction if replanner is None else replanner.prediction


def replanner_for(config: LazyTrainConfig, *, engine: ReplannedEngine, state: CurrentRun,
                  budgets: Budgets) -> Replanner:
    """The re-planner of a run of `config` within `budgets`; a profile measured on this
    machine (`hardware="auto"`, links not emulated) is saved calibrated for the next run
    of this workload."""
    from lazytrain_accel.config import OptimizerChoice
    from lazytrain_accel.run import setup
    save = None
    if config.hardware == "auto" and not config.emulate_async:
        def save(profile: HardwareProfile) -> None:
            _save_calibration(config, profile, state.run.model_profile)

    resident_update = state.run.plan.resident_update
    return Replanner(
        engine=engine, state=state, budgets=budgets,
        solve=lambda r: setup.solve_plan(config, r.model_profile, r.hardware,
                                         resident_update=resident_update,
                                         time_limit_s=config.solver_time_limit_s,
                                         budgets=budgets, running=r.plan),
        min_gain=config.replan_min_gain, save_profile=save,
        include_optimizer=config.optimizer == OptimizerChoice.HYBRID8BIT)


def _save_calibration(config: LazyTrainConfig, profile: HardwareProfile,
                      model_profile: ModelProfile) -> None:
    """Keep a run's calibration under its workload (`profiling/workload.py`): its rates
    were measured on this model's copies, groups and layers, and apply to no other."""
    import torch

    from lazytrain_accel.profiling.workload import rates_of, save_workload, workload_key

    key = workload_key(model_profile, device_name=profile.gpu_name,
                       threads=torch.get_num_threads())
    save_workload(config.cache_dir, key, rates_of(profile, source="calibrated by a run"))
