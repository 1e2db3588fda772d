"""`StepGuard`: the record of a LazyTrain run's optimizer steps, kept by
`run/step.py:OptimizerStep` (`record`, once per step).

* Non-finite gradients: the step is skipped (no weight or optimizer-state change) and
  counted once, by what decided it, in the run's one `SkipCount` (`skips`: the hybrid
  operator's own, shared at `OptimizerStep.install`); the guard reads it. After
  `max_nonfinite_skips` skips in a row training stops with an error naming the first
  parameter (and so the layer) whose gradient went bad.
* Ctrl-C: the first press only asks to stop; the step in progress finishes (weights and
  optimizer state stay consistent) and training stops at that step boundary. A second
  press interrupts at once, as usual.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from typing import Any, Protocol

import torch
from torch import nn

from lazytrain_accel.optim.skip_count import SkipCount

logger = logging.getLogger("lazytrain_accel")


class NonFiniteGradientError(RuntimeError):
    """Too many consecutive optimizer steps had inf/nan gradients."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training at a step boundary (the last step was applied whole)."""


class GuardedEngine(Protocol):
    """What the guard needs of the engine (`StreamingEngine`)."""

    def grad_sq_norms(self) -> dict[nn.Parameter, float]: ...

    def synchronize(self) -> None: ...


class StepGuard:
    def __init__(self, *, model: nn.Module, engine: GuardedEngine | None,
                 max_nonfinite_skips: int,
                 raise_on_interrupt: bool) -> None:
        self._named = list(model.named_parameters())
        self._layer_of = _decoder_layer_names(model)
        self._engine = engine
        self.max_nonfinite_skips = max_nonfinite_skips
        self.raise_on_interrupt = raise_on_interrupt
        self.steps = 0  # optimizer steps seen, skipped ones included
        #: the run's one count of skipped steps: what decides a step counts it there
        #: (`count_in` makes it the hybrid operator's)
        self.skips = SkipCount()
        self._skipped_before_streak = 0  # the count when the last step was applied
        self._first_bad: tuple[int, str] | None = None  # (step, parameter) of this streak
        self.interrupted = False
        self._previous_handler: Any = None

    # ---- the step ----------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """The run's skipped steps (`self.skips`, read only)."""
        return self.skips.skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Skipped steps since the last applied one."""
        return self.skips.skipped_steps - self._skipped_before_streak

    def count_in(self, skips: SkipCount) -> None:
        """Read the run's skipped steps from `skips` (the optimizer's, which decides and
        counts them) from now on; the current streak ends here."""
        self.skips = skips
        self._skipped_before_streak, self._first_bad = skips.skipped_steps, None

    def record(self, bad: str | None) -> None:
        """Record one optimizer step: applied (`bad` is None) or skipped because of a
        non-finite gradient in `bad` (counted already, by what decided it); raise once
        `max_nonfinite_skips` were in a row."""
        self.steps += 1
        if bad is None:
            self._skipped_before_streak, self._first_bad = self.skips.skipped_steps, None
        else:
            self._skip(bad)

    def stop_if_interrupted(self) -> None:
        """At a step boundary after a first Ctrl-C: stop (if this run raises)."""
        if self.interrupted and self.raise_on_interrupt:
            self._stop_at_boundary()

    def first_nonfinite(self) -> str | None:
        """Name of the first parameter whose gradient holds inf or nan, in backward order.

        Gradients flow from the head down, so an overflow in layer k spoils layers k..1
        and the embeddings; the first bad one in backward order is where it started.
        """
        known = self._engine.grad_sq_norms() if self._engine is not None else {}
        for name, param in reversed(self._named):
            if param.grad is None:
                continue
            sq = known.get(param)  # the engine's norms are measured as gradients land
            finite = math.isfinite(sq) if sq is not None else bool(
                torch.isfinite(param.grad).all())
            if not finite:
                layer = self._layer_of.get(id(param))
                return f"{layer}, parameter {name}," if layer else name
        return None

    def _skip(self, bad: str) -> None:
        if self._first_bad is None:
            self._first_bad = (self.steps, bad)
        logger.warning("lazytrain: non-finite gradient in %s at optimizer step %d; step "
                       "skipped (%d in a row, limit %d; %d skipped in this run)", bad,
                       self.steps, self.consecutive_skips, self.max_nonfinite_skips,
                       self.skipped_steps)
        if self.consecutive_skips >= self.max_nonfinite_skips:
            first_step, first_name = self._first_bad
            raise NonFiniteGradientError(
                f"{self.consecutive_skips} consecutive optimizer steps had non-finite "
                f"gradients (steps {first_step}..{self.steps}, all skipped: weights and "
                f"optimizer state are those after step {first_step - 1}). The first bad "
                f"gradient was in {first_name} at step {first_step} (in backward order: "
                "the layer where it started). Lower the learning "
                "rate, check that step's batch (labels, padding), prefer bf16 to fp16, or "
                "raise max_nonfinite_skips.")

    # ---- Ctrl-C ----------------------------------------------------------------------
    def install_sigint(self) -> None:
        """Defer the first Ctrl-C to the next step boundary (main thread only)."""
        if threading.current_thread() is not threading.main_thread() \
                or self._previous_handler is not None:
            return
        self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def restore_sigint(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.interrupted:  # second press: stop now (a caller that goes on starts afresh)
            self.interrupted = False
            self.restore_sigint()
            raise KeyboardInterrupt
        self.interrupted = True
        logger.warning("lazytrain: Ctrl-C received; stopping after the current optimizer "
                       "step. Press Ctrl-C again to stop immediately.")

    def _stop_at_boundary(self) -> None:
        if self._engine is not None:
            self._engine.synchronize()  # no transfer or update left running
        self.restore_sigint()
        raise TrainingInterrupted(
            f"training stopped by Ctrl-C after optimizer step {self.steps}, which was "
            "applied whole; save your state now (e.g. accelerator.save_state) to resume")


def _decoder_layer_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> "decoder layer j (its module name)" for streamed layers' params."""
    from lazytrain_accel.engine.model.discovery import find_decoder_layers

    _, _, layers = find_decoder_layers(model)
    names = {id(module): name for name, module in model.named_modules()}
    return {id(p): f"decoder layer {j} ({names[id(layer)]})"
            for j, layer in enumerate(layers, start=1) for p in layer.parameters()}
