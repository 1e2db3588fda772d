"""Admission: the largest batch, or the longest sequence, a strategy can plan within the
budgets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lazytrain_accel.planning.problem import PlanInfeasibleError
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.solve import make_plan
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile


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


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """Largest n <= `limit` with `fits(n)`, given `fits(1)` and monotone `fits` (double,
    then bisect: about 2 log2(n) probes)."""
    good, bad = 1, 2
    while bad <= limit and fits(bad):
        good, bad = bad, bad * 2
    bad = min(bad, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def max_batch_size(profile_at: Callable[[int], ModelProfile], hardware: HardwareProfile,
                   request: PlanRequest | None = None, *, limit: int = 1 << 16) -> int:
    """Largest batch b <= `limit` with a feasible plan for `request` (memory grows with b,
    so feasibility is monotone: double, then bisect). `profile_at(b)` profiles the model at
    batch b. Raises `PlanInfeasibleError` (binding tiers, shortfalls) when even b = 1
    does not fit."""
    request = request or PlanRequest()
    if not _fits(profile_at, 1, hardware, request):  # again, to raise with the reason
        make_plan(profile_at(1), hardware, request)
    return _largest(lambda b: _fits(profile_at, b, hardware, request), limit)


def max_seq_len(profile_at: Callable[[int], ModelProfile], hardware: HardwareProfile,
                request: PlanRequest | None = None, *, step_tokens: int = 1024,
                limit_tokens: int = 1 << 24) -> int:
    """Longest sequence, a multiple of `step_tokens` up to `limit_tokens`, with a feasible
    plan for `request`; `profile_at(s)` profiles the model at sequence length s (with
    tile_tokens=None the planner tiles as it would for a run). Memory grows with s, so
    feasibility is monotone: double, then bisect, as `max_batch_size`. Raises
    `PlanInfeasibleError` when not even `step_tokens` fits."""
    if step_tokens < 1 or limit_tokens < step_tokens:
        raise ValueError(f"step_tokens={step_tokens} must be >= 1 and <= limit_tokens="
                         f"{limit_tokens}")
    request = request or PlanRequest()

    def fits(steps: int) -> bool:
        return _fits(profile_at, steps * step_tokens, hardware, request)

    if not fits(1):  # again, to raise with the reason
        make_plan(profile_at(step_tokens), hardware, request)
    return step_tokens * _largest(fits, limit_tokens // step_tokens)
