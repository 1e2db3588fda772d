"""Batch admission: the largest batch a strategy can plan within the budgets."""

from __future__ import annotations

from collections.abc import Callable

from lazytrain_accel.planning.problem import Budgets, PlanInfeasibleError
from lazytrain_accel.planning.solve import make_plan
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile


def _fits(profile_at: Callable[[int], ModelProfile], batch_size: int,
          hardware: HardwareProfile, *, strategy: str, budgets: Budgets | None,
          max_recompute_block: int, time_limit_s: float, resident_update: str,
          include_optimizer: bool) -> bool:
    # The same call a run makes, so admission never promises a batch `make_plan` refuses
    # (the refusal's reason is not read here: no diagnosis solve).
    try:
        make_plan(profile_at(batch_size), hardware, strategy=strategy, budgets=budgets,
                  max_recompute_block=max_recompute_block, time_limit_s=time_limit_s,
                  diagnose_s=0.0, resident_update=resident_update,
                  include_optimizer=include_optimizer)
    except PlanInfeasibleError:
        return False
    return True


def max_batch_size(profile_at: Callable[[int], ModelProfile], hardware: HardwareProfile, *,
                   strategy: str = "lazytrain", budgets: Budgets | None = None,
                   max_recompute_block: int = 8, time_limit_s: float = 60.0,
                   limit: int = 1 << 16, resident_update: str = "auto",
                   include_optimizer: bool = True) -> int:
    """Largest batch b <= `limit` with a feasible `strategy` plan (memory grows with b, so
    feasibility is monotone: double, then bisect). `profile_at(b)` profiles the model at
    batch b. Raises `PlanInfeasibleError` (binding tiers, shortfalls) when even b = 1
    does not fit."""
    kwargs = dict(strategy=strategy, budgets=budgets, max_recompute_block=max_recompute_block,
                  time_limit_s=time_limit_s, resident_update=resident_update,
                  include_optimizer=include_optimizer)
    if not _fits(profile_at, 1, hardware, **kwargs):  # again, to raise with the reason
        make_plan(profile_at(1), hardware, **kwargs)
    good, bad = 1, 2
    while bad <= limit and _fits(profile_at, bad, hardware, **kwargs):
        good, bad = bad, bad * 2
    bad = min(bad, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(profile_at, mid, hardware, **kwargs) else (good, mid)
    return good
