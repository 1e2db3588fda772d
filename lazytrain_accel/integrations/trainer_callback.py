"""`LazyTrainCallback`: the plan and the engine's measurements in the Trainer's own logs.

Whatever watches the logs (TensorBoard, W&B, `trainer_state.json`, the console) then shows
them beside the loss: at train start the plan (boundary homes, predicted step and peaks),
and on every logging step the measured stall seconds, the predicted and measured step
seconds and the peak bytes per memory tier since the previous logging step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lazytrain_accel.integrations import setup

if TYPE_CHECKING:
    from transformers import Trainer

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

    # ---- what the engine and the plan say --------------------------------------------
    def _run_and_engine(self) -> tuple[setup.PreparedRun | None, Any]:
        accelerator = self._trainer.accelerator
        return (getattr(accelerator, "lazytrain_run", None),
                getattr(accelerator, "lazytrain_engine", None))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        run, engine = self._run_and_engine()
        if run is None:
            return
        if engine is not None:
            engine.reset_stats()
        guard = getattr(self._trainer.accelerator, "lazytrain_guard", None)
        if guard is not None:
            guard.install_sigint()  # again when train() runs more than once
        self._measured_s, self._steps = 0.0, 0
        if state.is_world_process_zero:
            logger.info("%s", setup.format_plan_summary(run.plan))
        self._trainer.log(plan_metrics(run.plan))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._step_start_s = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if self._step_start_s is not None:
            self._measured_s += time.perf_counter() - self._step_start_s
            self._steps += 1
            self._step_start_s = None
        guard = getattr(self._trainer.accelerator, "lazytrain_guard", None)
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
        guard = getattr(self._trainer.accelerator, "lazytrain_guard", None)
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
        logs.update(metrics)
        # Trainer.log appended a copy of `logs` to the history before calling us.
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(metrics)
        engine.reset_stats()
        self._measured_s, self._steps = 0.0, 0


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
