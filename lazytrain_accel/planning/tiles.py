"""Sequence tiles as a planning decision (`tile_tokens="auto"`).

At long sequence one layer's backward working set outgrows the GPU. Candidates, least
tiled first: untiled; token-wise tiles of `TILE_CHOICES_TOKENS` with whole-sequence
attention; the same tiles with the whole layer in sequence tiles (a layer that runs whole,
`profiling/whole_layers.py`: attention in query blocks). Each extra tile re-launches
kernels (`working_set.TILE_LAUNCH_S`), so the planner takes the fastest plan among the
least-tiled candidates that can fit. A candidate whose kernels would index 2^31 elements,
or whose fixed GPU bytes exceed the budget, is skipped without a solve; when none may
fit, the most tiled is planned so that the refusal names the term left over.
Docs: docs/planner.md "Long context".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from lazytrain_accel.planning.loss_head import auto_chunk_tokens
from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.problem import Budgets, PlanInfeasibleError, build_problem
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model_configs import with_loss_chunk, with_tiles
from lazytrain_accel.profiling.profile import ModelProfile
from lazytrain_accel.profiling.working_set import int32_index_overflow

#: Tile sizes the planner picks from, largest (fewest re-launches) first.
TILE_CHOICES_TOKENS = tuple(2**k for k in range(18, 9, -1))  # 256K .. 1K

#: Boundaries every plan homes on the GPU (0 and L, `Plan` indexing).
PINNED_GPU_BOUNDARIES = 2


def tile_candidates(model: ModelProfile) -> Iterator[ModelProfile]:
    """`model` untiled, then tiled, then tiled with query-blocked attention, each tile size
    largest first (only tiles shorter than the tokens, blocks shorter than a sequence)."""
    yield with_tiles(model, 0, 0)
    tokens = model.tokens_per_step
    for block in (False, True):
        for tile in TILE_CHOICES_TOKENS:
            if tile < (model.seq_len if block else tokens):
                yield with_tiles(model, tile, tile if block else 0)


def index_overflow(model: ModelProfile) -> str | None:
    """What in `model`'s layers, tiled as it says, reaches 2^31 elements (None: nothing)."""
    return int32_index_overflow(model.geometry, batch_size=model.batch_size,
                                seq_len=model.seq_len, tile_tokens=model.tile_tokens or 0,
                                attention_block_tokens=model.attention_block_tokens)


def may_fit(model: ModelProfile, hardware: HardwareProfile, budgets: Budgets, *,
            max_recompute_block: int) -> bool:
    """Whether `model`'s fixed GPU bytes (working set, weights, residents, staging,
    reserve) and the boundaries every plan homes there fit the GPU budget: a lower bound of
    every plan's device need, so False means no plan fits."""
    if model.loss_chunk_tokens is None:  # "auto": the head as the planner would size it
        model = with_loss_chunk(model, auto_chunk_tokens(model))
    p = build_problem(model, hardware, budgets=budgets, max_recompute_block=max_recompute_block)
    return p.gpu_fixed_bytes + PINNED_GPU_BOUNDARIES * p.boundary_bytes <= budgets.gpu_bytes


def plan_tiles(model: ModelProfile, hardware: HardwareProfile,
               plan_for: Callable[[ModelProfile], Plan], *, budgets: Budgets | None,
               max_recompute_block: int) -> Plan:
    """The fastest `plan_for` plan of the first candidate that plans and the one after it;
    raises the most tiled candidate's refusal when none may fit."""
    budgets = budgets or Budgets.from_hardware(hardware)
    candidates = list(tile_candidates(model))
    overflows = [index_overflow(c) for c in candidates]
    if all(overflows):
        whole = model.geometry.whole_layer_reason
        how = (f"its layers run whole ({whole}), attention in query blocks" if whole
               else "even with the whole layer in sequence tiles")
        raise PlanInfeasibleError(
            f"at batch {model.batch_size} x seq {model.seq_len} {overflows[-1]}, at or past "
            f"2^31, where kernels' int32 index math overflows, {how}: shorten --seq-len or "
            "the micro-batch.", {})
    candidates = [c for c, over in zip(candidates, overflows, strict=True) if over is None]
    fitting = [c for c in candidates
               if may_fit(c, hardware, budgets, max_recompute_block=max_recompute_block)]
    if not fitting:
        return plan_for(candidates[-1])  # raises, naming what one tile leaves over
    error = PlanInfeasibleError("no tile candidate planned", {})
    for i, candidate in enumerate(fitting):
        try:
            plan = plan_for(candidate)
        except PlanInfeasibleError as err:
            error = err
            continue
        if i + 1 == len(fitting):
            return plan
        try:  # one step more tiled: more room for GPU homes may buy speed
            finer = plan_for(fitting[i + 1])
        except PlanInfeasibleError:
            return plan
        return min(plan, finer, key=lambda p: p.prediction.step_s)
    raise error
