"""Plan fidelity while training: the predicted step beside the measured one, each interval.

A step is split into the same terms on both sides: `compute_s` (the streamed layers'
forward, backward and recompute), `exposed_s` (time the step waits on transfers and
updates; measured as the engine's stall seconds) and the rest (`other_s`: embeddings,
head and loss, optimizer, host overhead). When the measured step is off the prediction by
more than `tolerance` for `patience` intervals in a row, one warning names the term that
drifted most, so a user knows whether to re-profile compute, look at the links, or at
the work outside the streamed layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from lazytrain_accel.engine.stats import StepStats
from lazytrain_accel.planning.plan import Prediction

logger = logging.getLogger("lazytrain_accel")

_ADVICE = {
    "compute_s": "the hardware profile's compute rate does not match this machine; "
                 "re-profile it (`lazytrain profile --hardware auto`)",
    "exposed_s": "transfers or optimizer updates are less hidden than planned; check the "
                 "profile's link rates and other traffic on the bus or the host",
    "other_s": "work outside the streamed layers (embeddings, head, loss, optimizer, data "
               "loading, the host's weight staging and gradient folds) takes longer than "
               "planned",
}


@dataclass(frozen=True, kw_only=True)
class StepTerms:
    """One optimizer step in seconds, split as the plan's prediction is."""

    step_s: float
    compute_s: float  # streamed layers: forward, backward, recompute
    exposed_s: float  # waiting on transfers and updates

    @property
    def other_s(self) -> float:
        return self.step_s - self.compute_s - self.exposed_s

    @classmethod
    def predicted(cls, prediction: Prediction, *, micro_batches: int = 1) -> StepTerms:
        """The plan's prediction (one micro-batch) for a step of `micro_batches`."""
        return cls(step_s=prediction.step_s * micro_batches,
                   compute_s=(prediction.compute_s + prediction.recompute_s) * micro_batches,
                   exposed_s=prediction.exposed_s * micro_batches)

    @classmethod
    def measured(cls, step_s: float, stats: StepStats, *, steps: int = 1) -> StepTerms:
        """Per-step averages of `steps` steps that took `step_s` seconds in all."""
        steps = max(steps, 1)
        return cls(step_s=step_s / steps, compute_s=(stats.compute_s + stats.recompute_s) / steps,
                   exposed_s=stats.stall_s / steps)


class FidelityMonitor:
    """Compares measured steps with the plan's prediction; warns on a lasting drift."""

    def __init__(self, *, tolerance: float = 0.25, patience: int = 3,
                 interval_steps: int = 1) -> None:
        if tolerance <= 0 or patience < 1 or interval_steps < 1:
            raise ValueError(f"tolerance={tolerance} must be > 0, patience={patience} and "
                             f"interval_steps={interval_steps} >= 1")
        self.tolerance, self.patience, self.interval_steps = tolerance, patience, interval_steps
        self._drifting = 0
        self._pending: list[tuple[float, float, float]] = []

    def observe(self, predicted: StepTerms, measured: StepTerms) -> str:
        """One interval: returns its report line; warns once per lasting drift."""
        ratio = measured.step_s / predicted.step_s if predicted.step_s > 0 else float("inf")
        self._drifting = self._drifting + 1 if abs(ratio - 1) > self.tolerance else 0
        if self._drifting == self.patience:
            term = drifted_term(predicted, measured)
            logger.warning(
                "lazytrain: the measured step (%.3f s) has been %.2fx the plan's prediction "
                "(%.3f s) for %d logging intervals; the %s term drifted most (predicted "
                "%.3f s, measured %.3f s): %s", measured.step_s, ratio, predicted.step_s,
                self.patience, term, getattr(predicted, term), getattr(measured, term),
                _ADVICE[term])
        return (f"step predicted {predicted.step_s:.3f} s, measured {measured.step_s:.3f} s "
                f"({ratio:.2f}x); exposed predicted {predicted.exposed_s:.3f} s, measured "
                f"{measured.exposed_s:.3f} s")

    def add_step(self, prediction: Prediction, step_s: float, stats: StepStats,
                 report: Callable[[str], object]) -> None:
        """One step (stats of that step alone); every `interval_steps` steps, `report`
        gets the interval's line."""
        self._pending.append((step_s, stats.compute_s + stats.recompute_s, stats.stall_s))
        if len(self._pending) < self.interval_steps:
            return
        n = len(self._pending)
        step, compute, exposed = (sum(column) / n for column in zip(*self._pending, strict=True))
        self._pending.clear()
        measured = StepTerms(step_s=step, compute_s=compute, exposed_s=exposed)
        report(self.observe(StepTerms.predicted(prediction), measured))


def drifted_term(predicted: StepTerms, measured: StepTerms) -> str:
    """The term whose measured seconds differ most from the predicted ones."""
    return max(("compute_s", "exposed_s", "other_s"),
               key=lambda t: abs(getattr(measured, t) - getattr(predicted, t)))
