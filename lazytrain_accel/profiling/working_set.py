"""One layer's backward working set, term by term: the one formula the MIP's GPU row, the
simulator's static bytes and the refusals read (docs/planner.md, "Working set").

A streamed layer re-runs its forward from its input boundary and then runs its backward.
Its input boundary itself is not counted here: it is a GPU home or a staging slot of the
plan (`problem.py`). What is counted, per token (h = hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I = intermediate, b = compute bytes per element):

* attention, whole sequence (one SDPA flash / memory-efficient call, no S x S matrix):
  q, o, dO, dQ at q each, k, v, dK, dV at kv each, the kernel's fp32 dQ accumulator
  (4 q bytes) and the fp32 logsumexp (4 per head);
* attention in query blocks (`attention_block_tokens` > 0, `engine/query_blocks.py`): the
  layer around the attention call still makes and takes q, o, dO, dQ for the whole
  sequence (its projections are not blocked), and K, V, their fp32 gradient accumulators
  and the compute-dtype dK, dV partials of the last block's key prefix stay on the device;
  what exists for one block only is the SDPA backward's own: the block's re-computed
  output and dQ, its fp32 dQ accumulator and logsumexp;
* token-wise (the MLP, the block the engine tiles): the MLP intermediates autograd keeps
  (gate, up, act(gate), their product for a gated MLP; fc1 and its activation otherwise)
  and two I-wide transient gradients, for all tokens untiled or for one tile of
  `tile_tokens`;
* boundaries and norms ([S, h] tensors of the whole sequence): the layer's output
  gradient arriving and its input gradient leaving, the residual between attention and
  MLP, and each of the layer's `NORMS_PER_LAYER` norms' normalized input and output
  (autograd keeps both; outside the MLP nothing is tiled), plus the fp32 copy of its input
  an RMSNorm keeps when the compute dtype is narrower (measured against this formula on
  a CPU: `tests/integrations/test_long_sample.py`);
* weight gradients: the trainable ones before they stream to the host, plus the
  dequantized copy of the largest packed matrix (bitsandbytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lazytrain_accel.profiling.model import ModelGeometry, ModelProfile, WeightSplit

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

    @property
    def total_bytes(self) -> int:
        return (self.attention_bytes + self.token_wise_bytes + self.boundary_bytes
                + self.weight_grad_bytes)

    def terms(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of each term, largest first, as refusals name them."""
        return tuple(sorted(((ATTENTION_TERM, self.attention_bytes),
                             (TOKEN_WISE_TERM, self.token_wise_bytes),
                             (BOUNDARY_TERM, self.boundary_bytes),
                             (WEIGHT_GRAD_TERM, self.weight_grad_bytes)),
                            key=lambda t: -t[1]))


def query_side_bytes_per_token(g: ModelGeometry, bytes_per_elem: int) -> int:
    """q, o, dO, dQ, the fp32 dQ accumulator and the fp32 logsumexp of one query token."""
    q = g.num_attention_heads * g.head_dim
    return 4 * q * bytes_per_elem + FP32_BYTES * q + FP32_BYTES * g.num_attention_heads


def key_side_bytes_per_token(g: ModelGeometry, bytes_per_elem: int, *, blocked: bool) -> int:
    """k, v, dK, dV of one key token; in query blocks dK, dV are fp32 accumulators plus
    the compute-dtype partials one block's call returns."""
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
    `attention_block_tokens` per sequence (0: one call over the whole sequence)."""
    for name, value in (("tile_tokens", tile_tokens),
                        ("attention_block_tokens", attention_block_tokens)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0 (0: untiled)")
    tokens = batch_size * seq_len
    tile = min(tile_tokens or tokens, tokens)
    token_wise = tile * token_wise_bytes_per_token(g, bytes_per_elem)
    boundary = tokens * boundary_bytes_per_token(g, bytes_per_elem)
    if attention_block_tokens:
        block = min(attention_block_tokens, seq_len)
        whole_query = 4 * g.num_attention_heads * g.head_dim * bytes_per_elem  # q, o, dO, dQ
        attention = (tokens * (whole_query
                               + key_side_bytes_per_token(g, bytes_per_elem, blocked=True))
                     + batch_size * block * query_side_bytes_per_token(g, bytes_per_elem))
    else:
        attention = tokens * (key_side_bytes_per_token(g, bytes_per_elem, blocked=False)
                              + query_side_bytes_per_token(g, bytes_per_elem))
    grad_elems = g.layer_param_count if weights is None else (
        weights.layer_trainable_param_count + weights.layer_dequant_elems)
    return LayerWorkingSet(attention_bytes=attention, token_wise_bytes=token_wise,
                           boundary_bytes=boundary,
                           weight_grad_bytes=grad_elems * bytes_per_elem)


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


def exceeds_int32_index(*, tokens: int, width: int) -> bool:
    """Whether a [tokens, width] tensor has more elements than int32 indexing reaches."""
    return tokens * width >= INT32_INDEX_LIMIT_ELEMS


def device_working_terms(model: ModelProfile) -> tuple[tuple[str, int], ...]:
    """The device's working-set terms: the head + loss runs between the last forward and
    the first backward, so its working set and one layer's backward working set are never
    live together; the larger one is charged (the layer's term by term,
    `working_set.LayerWorkingSet`)."""
    if model.head_working_bytes > model.layer_working_bytes:
        return ((HEAD_WORKING_TERM, model.head_working_bytes),)
    return model.layer_working_terms or ((LAYER_WORKING_TERM, model.layer_working_bytes),)
