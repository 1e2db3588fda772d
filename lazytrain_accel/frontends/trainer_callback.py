"""`LazyTrainCallback`: the plan and the engine's measurements in the Trainer's own logs.

Whatever watches the logs (TensorBoard, W&B, `trainer_state.json`) then shows them
beside the loss: at train start the plan (boundary homes, predicted step and peaks), and
on every logging step the measured stall seconds, the predicted and measured step seconds
and the peak bytes per memory tier since the previous logging step, and the run's skipped
steps so far (`lazytrain/skipped_steps`: the guard's, the run's one count). The console lines
(progress bar, `PrinterCallback`) leave them out unless `--log_level debug` asks for them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from lazytrain_accel.engine.step.fidelity import FidelityMonitor, StepTerms
from lazytrain_accel.progress import PlainProgress, is_terminal
from lazytrain_accel.run import setup
from lazytrain_accel.run.replanner import current_prediction, predicted_step_s

if TYPE_CHECKING:
    from transformers import Trainer

    from lazytrain_accel.run.state import RunState

logger = logging.getLogger("lazytrain_accel")

PREFIX = "lazytrain/"


class LazyTrainCallback(TrainerCallback):
    """Adds `lazytrain/*` entries to the Trainer's logs.

    It must run before the reporting callbacks, which read the same `logs` dict; the
    Trainer integration inserts it first in the callback list.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._step_start_s: float | None = None
        self._measured_s = 0.0
        self._steps = 0
        self._fidelity = FidelityMonitor()  # predicted vs measured step, drift warnings
        self._plain: PlainProgress | None = None  # off a terminal: a line every few steps
        self._stall_seen_s = 0.0  # engine stall already counted in a progress line

    # ---- what the engine and the plan say --------------------------------------------
    def _state(self) -> RunState | None:
        """The run's state (None: a stock Accelerator, or before prepare)."""
        return getattr(self._trainer.accelerator, "lazytrain", None)

    def _run_and_engine(self) -> tuple[setup.PreparedRun | None, Any]:
        state = self._state()
        return (None, None) if state is None else (state.run, state.engine)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        run, engine = self._run_and_engine()
        if run is None:
            return
        if engine is not None:
            engine.reset_stats()
        self._state().guard.install_sigint()  # again when train() runs more than once
        self._measured_s, self._steps, self._plain = 0.0, 0, None
        if not self._state().sizing.provisional:  # no prediction for a shape not asked for
            self._trainer.log(plan_metrics(run.plan))  # prepare() logged the plan summary

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._step_start_s = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if self._step_start_s is not None:
            step_s = time.perf_counter() - self._step_start_s
            self._measured_s += step_s
            self._steps += 1
            self._step_start_s = None
            if state.is_world_process_zero and not is_terminal():
                self._print_plain_progress(args, state, step_s)
        lazytrain = self._state()
        guard = lazytrain.guard if lazytrain is not None else None
        if guard is not None and guard.interrupted:  # Ctrl-C: stop at this step boundary
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no"  # a checkpoint, if asked for
            logger.warning("lazytrain: stopping after step %d (Ctrl-C)%s", state.global_step,
                           "; saving a checkpoint" if control.should_save else "")

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        _, engine = self._run_and_engine()
        if engine is not None:
            engine.synchronize()  # train() returns with the last layer-wise update applied
        lazytrain = self._state()
        guard = lazytrain.guard if lazytrain is not None else None
        if guard is not None:
            guard.restore_sigint()
            guard.interrupted = False  # a later train() call runs again

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        run, engine = self._run_and_engine()
        if run is None or engine is None or logs is None or "loss" not in logs:
            return
        metrics = step_metrics(run, engine.stats(), measured_s=self._measured_s,
                               steps=self._steps,
                               grad_accum_steps=args.gradient_accumulation_steps)
        metrics[f"{PREFIX}skipped_steps"] = self._state().guard.skipped_steps
        logs.update(metrics)
        predicted = StepTerms.predicted(current_prediction(self._state().replanner, run.plan),
                                        micro_batches=args.gradient_accumulation_steps)
        measured = StepTerms.measured(self._measured_s, engine.stats(), steps=self._steps)
        logger.info("lazytrain: %s", self._fidelity.observe(predicted, measured))
        # Trainer.log appended a copy of `logs` to the history before calling us.
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(metrics)
        engine.reset_stats()
        self._measured_s, self._steps, self._stall_seen_s = 0.0, 0, 0.0

    def _print_plain_progress(self, args: TrainingArguments, state: TrainerState,
                              step_s: float) -> None:
        """The Trainer's bar shows nothing in a log file: a plain line every few steps."""
        run, engine = self._run_and_engine()
        if run is None or engine is None:
            return
        accum = args.gradient_accumulation_steps
        if self._plain is None:
            self._plain = PlainProgress(total_steps=state.max_steps or None)
        stall_s = engine.stats().stall_s  # since the last log's reset
        due = self._plain.due(state.global_step)  # read the loss (a device sync) only then
        line = self._plain.step_done(
            state.global_step, step_s=step_s, stall_s=stall_s - self._stall_seen_s,
            tokens=run.plan.batch_size * run.plan.seq_len * accum,
            loss=mean_loss_since_log(self._trainer, state) if due else None,
            predicted_step_s=accum * predicted_step_s(
                self._state().replanner, engine.plan))
        self._stall_seen_s = stall_s
        if line:
            print(f"lazytrain: {line}", flush=True)


def quiet_console(trainer: Trainer) -> None:
    """The console callbacks of `trainer` print logs without `lazytrain/*` keys (a line of
    only those is not printed), unless the lazytrain logger is at DEBUG."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback | PrinterCallback) \
                and "on_log" not in vars(callback):
            callback.on_log = _without_ours(callback.on_log)


def _without_ours(on_log: Any) -> Any:
    def filtered(args: TrainingArguments, state: TrainerState, control: TrainerControl,
                 logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if logs is None or logger.isEnabledFor(logging.DEBUG):
            return on_log(args, state, control, logs=logs, **kwargs)
        kept = {k: v for k, v in logs.items() if not k.startswith(PREFIX)}
        if len(kept) < len(logs) and not set(kept) - {"epoch", "step"}:
            return None  # the plan metrics line: nothing left to show
        return on_log(args, state, control, logs=kept, **kwargs)
    return filtered


def mean_loss_since_log(trainer: Trainer, state: TrainerState) -> float | None:
    """The training loss the Trainer's next log will report: its on-device sum since the
    last log (`_tr_loss`, over `global_step - _globalstep_last_logged` steps; read only,
    tests/frontends/test_trainer_progress.py fails if transformers renames them)."""
    total = getattr(trainer, "_tr_loss", None)
    last_logged = getattr(trainer, "_globalstep_last_logged", None)
    if not isinstance(total, torch.Tensor) or not isinstance(last_logged, int):
        return None
    steps = state.global_step - last_logged
    return float(total.detach()) / steps if steps > 0 else None


def plan_metrics(plan: Any) -> dict[str, float]:
    """Scalars describing the plan, logged once at train start."""
    homes = plan.count_homes()
    pred = plan.prediction
    out: dict[str, float] = {f"{PREFIX}plan_{home}_boundaries": float(n)
                             for home, n in homes.items()}
    out.update({
        f"{PREFIX}plan_step_s_predicted": float(pred.step_s),
        f"{PREFIX}plan_exposed_s_predicted": float(pred.exposed_s),
        f"{PREFIX}plan_peak_gpu_bytes": float(pred.peak_gpu_bytes),
        f"{PREFIX}plan_peak_cpu_bytes": float(pred.peak_cpu_bytes),
        f"{PREFIX}plan_peak_nvme_bytes": float(pred.peak_nvme_bytes),
        f"{PREFIX}plan_solve_s": float(plan.solver.solve_s),
    })
    return out


def step_metrics(run: setup.PreparedRun, stats: Any, *, measured_s: float, steps: int,
                 grad_accum_steps: int) -> dict[str, float]:
    """Per-optimizer-step averages since the previous log, and peaks over that span.

    The plan predicts one micro-batch; an optimizer step runs `grad_accum_steps` of them.
    """
    steps = max(steps, 1)
    out = {
        f"{PREFIX}stall_s": stats.stall_s / steps,
        f"{PREFIX}step_s_predicted": run.plan.prediction.step_s * grad_accum_steps,
        f"{PREFIX}step_s_measured": measured_s / steps,
        f"{PREFIX}recompute_s": stats.recompute_s / steps,
    }
    for tier, nbytes in stats.peak_bytes.items():
        out[f"{PREFIX}peak_{tier}_bytes"] = float(nbytes)
    return out
