"""`SkipCount`: the one count of optimizer steps skipped for non-finite gradients.

Whoever decides a step counts it here, once: `HybridAdamW8bit.begin_step` (its global
norm is not finite), or, for an optimizer that does not decide it itself
(`optimizer="keep"`), the run's step (`run/step.py:OptimizerStep`). On a LazyTrain run
the hybrid operator and the run's `StepGuard` hold the same `SkipCount`
(`OptimizerStep.install`), so `optimizer.skipped_steps`, `guard.skipped_steps`, the
guard's streak and its warnings all read this one number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, eq=False)
class SkipCount:
    #: optimizer steps skipped so far (not applied: no weight or state changed)
    skipped_steps: int = 0

    def add(self) -> int:
        """Count one skipped step; returns the count so far."""
        self.skipped_steps += 1
        return self.skipped_steps
