"""An infeasible run's error, completed with the largest micro-batch that does plan.

`make_plan` names the binding tiers; a person then wants to know what *would* fit. The
answer is `max_batch_size` bounded by the requested batch, so it costs about
log2(batch) plans, and only when the run was refused anyway.
"""

from __future__ import annotations

from collections.abc import Callable

from lazytrain_accel.planning.admission import max_batch_size
from lazytrain_accel.planning.problem import PlanInfeasibleError
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile


class BatchInfeasibleError(PlanInfeasibleError):
    """`PlanInfeasibleError` plus `largest_batch_size`: the largest micro-batch below the
    requested one that plans at the same sequence length (0 when not even 1 does)."""

    def __init__(self, message: str, shortfall_bytes: dict[str, int],
                 largest_batch_size: int) -> None:
        super().__init__(message, shortfall_bytes)
        self.largest_batch_size = largest_batch_size


def with_largest_batch(err: PlanInfeasibleError, profile_at: Callable[[int], ModelProfile],
                       hardware: HardwareProfile, request: PlanRequest, *, batch_size: int,
                       seq_len: int) -> BatchInfeasibleError:
    """`err` with one more sentence: the largest batch < `batch_size` that plans for
    `request` (the refused run's)."""
    largest = 0
    if batch_size > 1:
        try:
            largest = max_batch_size(profile_at, hardware, request, limit=batch_size - 1)
        except PlanInfeasibleError:
            largest = 0
    if largest:
        hint = (f"The largest micro-batch that plans at seq {seq_len} is {largest} "
                f"(asked: {batch_size}); keep the global batch with gradient accumulation.")
    else:
        hint = (f"Not even micro-batch 1 plans at seq {seq_len}: shorten the sequence or "
                "raise the budgets named above.")
    return BatchInfeasibleError(f"{err} {hint}", dict(err.shortfall_bytes), largest)
