"""Plain progress lines for logs: when stdout is not a terminal (CI, nohup, a cluster job,
the Trainer's log file) a progress bar prints nothing a person can follow, so the demo
and the Trainer callback print one line every `PROGRESS_EVERY_STEPS` optimizer steps
(and at the first and the last): step, loss, tokens/s, stall, measured vs predicted step.
"""

from __future__ import annotations

import sys
from typing import TextIO

#: Optimizer steps between two plain progress lines.
PROGRESS_EVERY_STEPS = 10


def is_terminal(stream: TextIO | None = None) -> bool:
    """True when `stream` (default: stdout) is an interactive terminal."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class PlainProgress:
    """Averages over the steps since the previous line; `step_done` returns the line to
    print when one is due, else None."""

    def __init__(self, *, total_steps: int | None, every_steps: int = PROGRESS_EVERY_STEPS,
                 loss_label: str = "loss") -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps={every_steps} must be >= 1")
        self.total_steps = total_steps
        self.every_steps = every_steps
        self.loss_label = loss_label
        self._span_s = self._stall_s = 0.0
        self._tokens = self._steps = 0

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) gets a line."""
        return step == 1 or step % self.every_steps == 0 or step == self.total_steps

    def step_done(self, step: int, *, step_s: float, stall_s: float, tokens: int,
                  loss: float | None, predicted_step_s: float) -> str | None:
        """Record optimizer step `step` (1-based); the line, if this step gets one.
        `predicted_step_s` is the plan's step as predicted now: once the re-planner has
        calibrated the profile, at the measured rates (`Replanner.predicted_step_s`)."""
        self._span_s += step_s
        self._stall_s += stall_s
        self._tokens += tokens
        self._steps += 1
        if not self.due(step):
            return None
        line = self._format(step, loss, predicted_step_s)
        self._span_s = self._stall_s = 0.0
        self._tokens = self._steps = 0
        return line

    def _format(self, step: int, loss: float | None, predicted_step_s: float) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        mean_s = self._span_s / self._steps
        loss_text = f"{self.loss_label} {loss:.4f}" if loss is not None else f"{self.loss_label} -"
        tokens_per_s = self._tokens / self._span_s if self._span_s > 0 else 0.0
        return (f"step {step}{total}  {loss_text}  {tokens_per_s:,.0f} tok/s  "
                f"stall {self._stall_s / self._steps * 1e3:.1f} ms  "
                f"step {mean_s:.3f} s (predicted {predicted_step_s:.3f} s)")
