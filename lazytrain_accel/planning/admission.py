"""Admission: the largest batch, or the longest sequence, a strategy can plan within the
budgets."""

from __future__ import annotations

from collections.abc import Callable

from lazytrain_accel.planning.problem import Budgets, PlanInfeasibleError
from lazytrain_accel.planning.solve import make_plan
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile


def _fits(profile_at: Callable[[int], ModelProfile], size: int,
          hardware: HardwareProfile, *, strategy: str, budgets: Budgets | None,
          max_recompute_block: int, time_limit_s: float, resident_update: str,
          include_optimizer: bool) -> bool:
    # The same call a run makes, so admission never promises a batch `make_plan` refuses
    # (the refusal's reason is not read here: no diagnosis solve).
    try:
        make_plan(profile_at(size), hardware, strategy=strategy, budgets=budgets,
                  max_recompute_block=max_recompute_block, time_limit_s=time_limit_s,
                  diagnose_s=0.0, resident_update=resident_update,
                  include_optimizer=include_optimizer)
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
    return _largest(lambda b: _fits(profile_at, b, hardware, **kwargs), limit)


def max_seq_len(profile_at: Callable[[int], ModelProfile], hardware: HardwareProfile, *,
                step_tokens: int = 1024, limit_tokens: int = 1 << 24,
                strategy: str = "lazytrain", budgets: Budgets | None = None,
                max_recompute_block: int = 8, time_limit_s: float = 60.0,
                resident_update: str = "auto", include_optimizer: bool = True) -> int:
    """Longest sequence, a multiple of `step_tokens` up to `limit_tokens`, with a feasible
    `strategy` plan; `profile_at(s)` profiles the model at sequence length s (with
    tile_tokens=None the planner tiles as it would for a run). Memory grows with s, so
    feasibility is monotone: double, then bisect, as `max_batch_size`. Raises
    `PlanInfeasibleError` when not even `step_tokens` fits."""
    if step_tokens < 1 or limit_tokens < step_tokens:
        raise ValueError(f"step_tokens={step_tokens} must be >= 1 and <= limit_tokens="
                         f"{limit_tokens}")
    kwargs = dict(strategy=strategy, budgets=budgets, max_recompute_block=max_recompute_block,
                  time_limit_s=time_limit_s, resident_update=resident_update,
                  include_optimizer=include_optimizer)

    def fits(steps: int) -> bool:
        return _fits(profile_at, steps * step_tokens, hardware, **kwargs)

    if not fits(1):  # again, to raise with the reason
        make_plan(profile_at(step_tokens), hardware, **kwargs)
    return step_tokens * _largest(fits, limit_tokens // step_tokens)
