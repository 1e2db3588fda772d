"""Batch admission: the largest batch a strategy can plan within the budgets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lazytrain_accel.planning.problem import PlanInfeasibleError
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.solve import make_plan
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile


def _fits(profile_at: Callable[[int], ModelProfile], batch_size: int,
          hardware: HardwareProfile, request: PlanRequest) -> bool:
    # The same call a run makes, so admission never promises a batch `make_plan` refuses
    # (the refusal's reason is not read here: no diagnosis solve).
    try:
        make_plan(profile_at(batch_size), hardware,
                  dataclasses.replace(request, diagnose_s=0.0))
    except PlanInfeasibleError:
        return False
    return True


def max_batch_size(profile_at: Callable[[int], ModelProfile], hardware: HardwareProfile,
                   request: PlanRequest | None = None, *, limit: int = 1 << 16) -> int:
    """Largest batch b <= `limit` with a feasible plan for `request` (memory grows with b,
    so feasibility is monotone: double, then bisect). `profile_at(b)` profiles the model at
    batch b. Raises `PlanInfeasibleError` (binding tiers, shortfalls) when even b = 1
    does not fit."""
    request = request or PlanRequest()
    if not _fits(profile_at, 1, hardware, request):  # again, to raise with the reason
        make_plan(profile_at(1), hardware, request)
    good, bad = 1, 2
    while bad <= limit and _fits(profile_at, bad, hardware, request):
        good, bad = bad, bad * 2
    bad = min(bad, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(profile_at, mid, hardware, request) else (good, mid)
    return good
