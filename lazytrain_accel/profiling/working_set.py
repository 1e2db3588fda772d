"""One layer's backward working set, term by term: the one formula the MIP's GPU row, the
simulator's static bytes and the refusals read.

A streamed layer re-runs its forward from its input boundary, then runs its backward; the
input boundary itself is a GPU home or a staging slot of the plan (`problem.py`), not
counted here. The terms (attention, token-wise, boundaries and norms, weight gradients),
untiled, with the MLP in tiles or with the whole layer in sequence tiles (then only K, V,
their gradients and one [S, h] gradient are whole-sequence), with their symbols:
docs/planner.md "Long context"; `tests/frontends/test_long_sample.py` measures them on
a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lazytrain_accel.profiling.profile import ModelGeometry, ModelProfile, WeightSplit

#: Bytes of an fp32 element (accumulators, logsumexp).
FP32_BYTES = 4
#: Seconds each extra tile or query block adds to one pass over a layer: the re-launch
#: of its kernels (about ten per tile, ~10 us each). The forward and the re-run pay it
#: once, the backward twice (it launches about twice the kernels). An estimate.
TILE_LAUNCH_S = 1e-4
#: Norms of a pre-norm decoder layer (before attention, before the MLP).
NORMS_PER_LAYER = 2
#: Elements a kernel indexing with int32 can address: S x hidden at or past it needs the
#: engine to chunk (tiles do; a whole-sequence [S, h] op does not).
INT32_INDEX_LIMIT_ELEMS = 2**31

ATTENTION_TERM = "one layer's attention working set"
TOKEN_WISE_TERM = "one layer's token-wise working set (MLP, norms, projections)"
BOUNDARY_TERM = "one layer's boundary gradients, residual and norm outputs"
#: The boundary term of a sequence-tiled layer: its norms and residual are one tile's.
TILED_BOUNDARY_TERM = "one layer's output gradient (overwritten by its input gradient)"
WEIGHT_GRAD_TERM = "one layer's weight gradients"
HEAD_WORKING_TERM = "the loss head's working set"
#: A hand-built profile's working set, without terms.
LAYER_WORKING_TERM = "one layer's backward working set"


@dataclass(kw_only=True, frozen=True)
class LayerWorkingSet:
    """Peak extra device bytes while one layer re-runs its forward and runs its backward,
    by term (the terms are summed: a conservative peak)."""

    attention_bytes: int
    token_wise_bytes: int
    boundary_bytes: int
    weight_grad_bytes: int
    sequence_tiled: bool = False  # the whole layer in tiles (`engine/sequence/layer_tiles.py`)

    @property
    def total_bytes(self) -> int:
        return (self.attention_bytes + self.token_wise_bytes + self.boundary_bytes
                + self.weight_grad_bytes)

    def terms(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of each term, largest first, as refusals name them."""
        return tuple(sorted(((ATTENTION_TERM, self.attention_bytes),
                             (TOKEN_WISE_TERM, self.token_wise_bytes),
                             (TILED_BOUNDARY_TERM if self.sequence_tiled else BOUNDARY_TERM,
                              self.boundary_bytes),
                             (WEIGHT_GRAD_TERM, self.weight_grad_bytes)),
                            key=lambda t: -t[1]))


def query_side_bytes_per_token(g: ModelGeometry, bytes_per_elem: int) -> int:
    """q, o, dO, dQ, the fp32 dQ accumulator and the fp32 logsumexp of one query token."""
    q = g.num_attention_heads * g.head_dim
    return 4 * q * bytes_per_elem + FP32_BYTES * q + FP32_BYTES * g.num_attention_heads


def key_side_bytes_per_token(g: ModelGeometry, bytes_per_elem: int, *, blocked: bool) -> int:
    """k, v, dK, dV of one key token; in tiles (blocked) dK, dV are fp32 accumulators plus
    the compute-dtype partials SDPA backward returns for the key prefix: counted for every
    kv head, an upper bound (the engine re-runs one kv head at a time, whose partials and a
    GQA flash kernel's expansion of them to the head's query heads are (1 + group) / kv
    heads of this)."""
    kv = g.num_kv_heads * g.head_dim
    if blocked:
        return kv * (2 * bytes_per_elem + 2 * FP32_BYTES + 2 * bytes_per_elem)
    return 4 * kv * bytes_per_elem


def token_wise_bytes_per_token(g: ModelGeometry, bytes_per_elem: int) -> int:
    """MLP intermediates kept for backward + two transient I-wide gradients, of one token."""
    saved = 4 if g.gated_mlp else 2
    return (saved + 2) * g.intermediate_size * bytes_per_elem


def boundary_bytes_per_token(g: ModelGeometry, bytes_per_elem: int) -> int:
    """dOut, dx, the mid residual and the norms' kept tensors, of one token."""
    fp32_input = FP32_BYTES if bytes_per_elem < FP32_BYTES else 0
    per_norm = 2 * bytes_per_elem + fp32_input
    return g.hidden_size * (3 * bytes_per_elem + NORMS_PER_LAYER * per_norm)


def layer_working_set(g: ModelGeometry, *, batch_size: int, seq_len: int,
                      bytes_per_elem: int, weights: WeightSplit | None,
                      tile_tokens: int = 0, attention_block_tokens: int = 0
                      ) -> LayerWorkingSet:
    """One layer's backward working set at `batch_size` x `seq_len`, its token-wise parts
    in tiles of `tile_tokens` (0: untiled) and its attention in query blocks of
    `attention_block_tokens` per sequence (0: one call over the whole sequence). Query
    blocks shorter than the sequence run the whole layer in sequence tiles
    (`_sequence_tiled`) unless `g` says its layers run whole (`runs_in_tiles`); those
    are sized as they run: untiled, the MLP in tiles and attention in query blocks, q, o,
    dO, dQ of the whole sequence."""
    for name, value in (("tile_tokens", tile_tokens),
                        ("attention_block_tokens", attention_block_tokens)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0 (0: untiled)")
    tokens = batch_size * seq_len
    blocked = bool(attention_block_tokens) and attention_block_tokens < seq_len
    if blocked and runs_in_tiles(g):
        return _sequence_tiled(g, batch_size=batch_size, seq_len=seq_len,
                               bytes_per_elem=bytes_per_elem, weights=weights,
                               tile_tokens=tile_tokens, block_tokens=attention_block_tokens)
    tile = min(tile_tokens or tokens, tokens)
    token_wise = tile * token_wise_bytes_per_token(g, bytes_per_elem)
    boundary = tokens * boundary_bytes_per_token(g, bytes_per_elem)
    if blocked:  # a layer run whole, its attention in query blocks (`query_blocks.py`)
        whole_query = 4 * g.num_attention_heads * g.head_dim * bytes_per_elem  # q, o, dO, dQ
        attention = (tokens * (whole_query
                               + key_side_bytes_per_token(g, bytes_per_elem, blocked=True))
                     + batch_size * attention_block_tokens
                     * query_side_bytes_per_token(g, bytes_per_elem))
    else:
        attention = tokens * (key_side_bytes_per_token(g, bytes_per_elem, blocked=False)
                              + query_side_bytes_per_token(g, bytes_per_elem))
    return LayerWorkingSet(attention_bytes=attention, token_wise_bytes=token_wise,
                           boundary_bytes=boundary,
                           weight_grad_bytes=_grad_elems(g, weights) * bytes_per_elem)


def runs_in_tiles(g: ModelGeometry) -> bool:
    """Whether `g`'s layers run in sequence tiles when the plan has query blocks: not where
    the config says they run whole (`whole_layers.whole_layer_reason`, which the engine
    reads too)."""
    return not g.whole_layer_reason


def _grad_elems(g: ModelGeometry, weights: WeightSplit | None) -> int:
    return g.layer_param_count if weights is None else (
        weights.layer_trainable_param_count + weights.layer_dequant_elems)


def _sequence_tiled(g: ModelGeometry, *, batch_size: int, seq_len: int, bytes_per_elem: int,
                    weights: WeightSplit | None, tile_tokens: int, block_tokens: int
                    ) -> LayerWorkingSet:
    """A layer run in tiles of `block_tokens` positions (`engine/sequence/layer_tiles.py`): K, V and
    their gradients whole, and one [S, h] gradient (the input gradient overwrites the
    output gradient tile by tile), one tile's working set besides
    (the untiled formula at the tile's `batch_size` x `block_tokens` tokens, its MLP in
    tiles of `tile_tokens`), weight gradients summed in fp32 beside one tile's."""
    tokens = batch_size * seq_len
    tile = batch_size * block_tokens
    one = layer_working_set(g, batch_size=batch_size, seq_len=block_tokens,
                            bytes_per_elem=bytes_per_elem, weights=weights,
                            tile_tokens=tile_tokens)
    # one tile's attention: its q side; its k, v rows are the buffers' (counted whole)
    attention = (tokens * key_side_bytes_per_token(g, bytes_per_elem, blocked=True)
                 + tile * query_side_bytes_per_token(g, bytes_per_elem))
    grads = _grad_elems(g, weights)
    return LayerWorkingSet(
        attention_bytes=attention,
        token_wise_bytes=one.token_wise_bytes + one.boundary_bytes,
        boundary_bytes=tokens * g.hidden_size * bytes_per_elem,
        weight_grad_bytes=grads * (max(bytes_per_elem, FP32_BYTES) + bytes_per_elem),
        sequence_tiled=True)


def extra_launches(*, batch_size: int, seq_len: int, tile_tokens: int,
                   attention_block_tokens: int) -> int:
    """Tiles and query blocks beyond the one call each an untiled layer makes per pass."""
    tokens = batch_size * seq_len
    tiles = math.ceil(tokens / tile_tokens) if tile_tokens else 1
    blocks = (batch_size * math.ceil(seq_len / attention_block_tokens)
              if attention_block_tokens else batch_size)
    return (tiles - 1) + (blocks - batch_size)


def tile_overhead_s(*, batch_size: int, seq_len: int, tile_tokens: int,
                    attention_block_tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds the tiles and query blocks add to one layer."""
    n = extra_launches(batch_size=batch_size, seq_len=seq_len, tile_tokens=tile_tokens,
                       attention_block_tokens=attention_block_tokens)
    return n * TILE_LAUNCH_S, 2 * n * TILE_LAUNCH_S


def key_pass_flops(g: ModelGeometry, *, batch_size: int, seq_len: int,
                   attention_block_tokens: int) -> int:
    """FLOPs a sequence-tiled layer's backward adds (`engine/sequence/layer_tiles.py`): its key pass
    re-runs each tile up to attention, the q, k, v projections the largest part of it."""
    if not attention_block_tokens or attention_block_tokens >= seq_len or not runs_in_tiles(g):
        return 0
    qkv = g.hidden_size * (g.num_attention_heads + 2 * g.num_kv_heads) * g.head_dim
    return 2 * batch_size * seq_len * qkv


def exceeds_int32_index(*, tokens: int, width: int) -> bool:
    """Whether a [tokens, width] tensor has more elements than int32 indexing reaches."""
    return tokens * width >= INT32_INDEX_LIMIT_ELEMS


def int32_index_overflow(g: ModelGeometry, *, batch_size: int, seq_len: int, tile_tokens: int,
                         attention_block_tokens: int) -> str | None:
    """The first tensor a layer's kernels index whole that reaches 2^31 elements (int32
    index math overflows), or None. Sequence-tiled layers index one tile's tensors and the
    [batch x sequence, kv] K, V and their gradients (the [S, hidden] boundaries are only
    sliced and copied); otherwise the whole [batch x sequence, hidden] hidden state and the
    MLP's [tokens, intermediate] (per tile when tiled)."""
    tokens = batch_size * seq_len
    kv = g.num_kv_heads * g.head_dim
    if attention_block_tokens and attention_block_tokens < seq_len and runs_in_tiles(g):
        tile = batch_size * attention_block_tokens
        mlp = min(tile_tokens or tile, tile)
        widths = [(f"K and V ([batch x sequence, {kv}])", tokens, kv),
                  (f"one tile's hidden state ([{tile}, {g.hidden_size}])", tile,
                   max(g.hidden_size, g.num_attention_heads * g.head_dim)),
                  (f"one tile's MLP intermediate ([{mlp}, {g.intermediate_size}])", mlp,
                   g.intermediate_size)]
    else:
        mlp = min(tile_tokens or tokens, tokens)
        widths = [(f"the hidden state ([batch x sequence, {g.hidden_size}])", tokens,
                   g.hidden_size),
                  (f"the MLP intermediate ([{mlp}, {g.intermediate_size}])", mlp,
                   g.intermediate_size)]
    for what, rows, width in widths:
        if exceeds_int32_index(tokens=rows, width=width):
            return f"{what}: {rows * width:,} elements"
    return None


def device_working_terms(model: ModelProfile) -> tuple[tuple[str, int], ...]:
    """The device's working-set terms: the head + loss runs between the last forward and
    the first backward, so its working set and one layer's backward working set are never
    live together; the larger one is charged (the layer's term by term,
    `working_set.LayerWorkingSet`)."""
    if model.head_working_bytes > model.layer_working_bytes:
        return ((HEAD_WORKING_TERM, model.head_working_bytes),)
    return model.layer_working_terms or ((LAYER_WORKING_TERM, model.layer_working_bytes),)
