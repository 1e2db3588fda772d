"""Sequence-tiled decoder layers (`Plan.tiling` "layer").

Only attention mixes tokens, so a layer runs over tiles of `attention_block_tokens`
positions, its own `forward` called on each tile, while transformers' attention interface
points at `LAYER_TILES_ATTENTION`, which sees the tile's q, k, v. Forward: each tile's k, v
fill one K and V buffer and its queries attend to the key prefix, so its output is final.
Backward: a key pass refills K, V (`_KeysDone`), then the tiles re-run in reverse with
grad, `_TileAttention` summing the prefix's dK, dV in fp32; each tile replays its forward's
RNG state. Whole-sequence tensors are only K, V, their gradients, one SDPA call's dK, dV
partials and one [S, hidden] gradient (`profiling/working_set.py`). A layer this cannot
run in tiles (`Unsupported`) runs whole. Design: docs/engine.md "Long context".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lazytrain_accel.engine.model import captures
from lazytrain_accel.engine.model.replay import ReplayState, capture, replaying
from lazytrain_accel.engine.sequence.attention import block_attention, refuse_unsupported
from lazytrain_accel.engine.sequence.long_sequence import INDEX_LIMIT_ELEMENTS, LongSequenceError

#: The attention implementation name a sequence-tiled layer runs under.
LAYER_TILES_ATTENTION = "lazytrain_layer_tiles"
#: Queries x keys of one SDPA call off CUDA: there the causal offset is a [rows, keys]
#: mask (float inside the CPU flash kernel), so a tile's queries run in row blocks of at
#: most this many mask elements (16 MiB as fp32). CUDA builds no mask: one call per tile.
MASK_ELEMS = 1 << 22


class Unsupported(Exception):
    """This layer cannot run in sequence tiles (the runtime runs it whole instead)."""


class _KeysDone(Exception):
    """Raised by the key pass at the tile's attention call: the rest of the tile is not
    needed to fill K and V."""


@dataclass(kw_only=True)
class _Tiles:
    """The running layer's tiles: mode, the current tile, and the K, V buffers."""

    mode: str  # "forward", "keys" or "grad"
    seq: int
    start: int = 0
    end: int = 0
    calls: int = 0  # attention calls in the current tile
    key: torch.Tensor | None = None  # [batch, kv_heads, S, d]
    value: torch.Tensor | None = None
    grad_key: torch.Tensor | None = None  # fp32 accumulators, "grad" mode
    grad_value: torch.Tensor | None = None
    replays: list[ReplayState] = field(default_factory=list)

    def begin(self, start: int, end: int) -> None:
        self.start, self.end, self.calls = start, end, 0

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.key is None:
            elems = key.shape[0] * key.shape[1] * self.seq * max(key.shape[-1], value.shape[-1])
            if elems >= INDEX_LIMIT_ELEMENTS:
                raise LongSequenceError(
                    f"a sequence-tiled layer's K and V ([{key.shape[0]}, {key.shape[1]}, "
                    f"{self.seq}, {key.shape[-1]}]) reach {elems:,} elements, at or past 2^31 "
                    "where kernels' int32 indexing overflows: train on shorter sequences")
            self.key = key.new_empty(*key.shape[:2], self.seq, key.shape[-1])
            self.value = value.new_empty(*value.shape[:2], self.seq, value.shape[-1])
        self.key[:, :, self.start:self.end] = key.detach()
        self.value[:, :, self.start:self.end] = value.detach()


_running: ContextVar[_Tiles | None] = ContextVar("lazytrain_layer_tiles", default=None)


def _bounds(seq: int, block: int) -> list[tuple[int, int]]:
    return [(a, min(a + block, seq)) for a in range(0, seq, block)]


def applies(hidden: torch.Tensor, block_tokens: int) -> bool:
    """Whether a layer call on `hidden` ([batch, S, hidden]) runs in more than one tile."""
    return block_tokens > 0 and hidden.dim() == 3 and hidden.shape[1] > block_tokens


@contextmanager
def _dispatching(configs: list[Any], tiles: _Tiles) -> Iterator[None]:
    saved = [c._attn_implementation for c in configs]
    token = _running.set(tiles)
    for config in configs:
        config._attn_implementation = LAYER_TILES_ATTENTION
    try:
        yield
    finally:
        for config, name in zip(configs, saved, strict=True):
            config._attn_implementation = name
        _running.reset(token)


def _cutters(kwargs: dict[str, Any], seq: int) -> tuple[list[Any], pytree.TreeSpec,
                                                        list[tuple[int, int]]]:
    """The call's kwargs leaves, and which of them are per token: (leaf, dim) of each
    tensor with a dimension of `seq` (the first after the batch dim; a 1-D one's only)."""
    leaves, spec = pytree.tree_flatten(kwargs)
    cuts = []
    for k, v in enumerate(leaves):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        dims = [0] if v.dim() == 1 else range(1, v.dim())
        dim = next((d for d in dims if v.shape[d] == seq), None)
        if dim is not None:
            cuts.append((k, dim))
    return leaves, spec, cuts


def _tile_kwargs(leaves: list[Any], spec: pytree.TreeSpec, cuts: list[tuple[int, int]],
                 start: int, end: int) -> dict[str, Any]:
    tiled = list(leaves)
    for k, dim in cuts:
        tiled[k] = leaves[k].narrow(dim, start, end - start)
    return pytree.tree_unflatten(tiled, spec)


def _hidden_out(out: Any, tile: torch.Tensor) -> torch.Tensor:
    tensors = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
    if len(tensors) != 1 or tensors[0].shape[:2] != tile.shape[:2]:
        raise Unsupported(f"it returned {len(tensors)} tensors, not just its hidden state")
    return tensors[0]


def _restore_rng(state: ReplayState) -> None:
    torch.set_rng_state(state.cpu_rng)
    if state.cuda_rng is not None:
        torch.cuda.set_rng_state(state.cuda_rng, state.device)


def forward(original: Callable[..., Any], hidden: torch.Tensor, kwargs: dict[str, Any], *,
            block_tokens: int, configs: list[Any]) -> tuple[Any, list[ReplayState]]:
    """The layer's output on `hidden`, run in tiles of `block_tokens` positions with no
    graph; and the RNG state each tile started from, for its backward. Raises
    `Unsupported` (the RNG as it was) where the layer cannot run in tiles."""
    seq = hidden.shape[1]
    leaves, spec, cuts = _cutters(kwargs, seq)
    tiles = _Tiles(mode="forward", seq=seq)
    out: torch.Tensor | None = None
    first: Any = None
    with _dispatching(configs, tiles), torch.no_grad():
        for start, end in _bounds(seq, block_tokens):
            tiles.replays.append(capture(hidden.device))
            tiles.begin(start, end)
            prior = captures.collector_lengths()
            tile = hidden[:, start:end]
            try:
                result = original(tile, **_tile_kwargs(leaves, spec, cuts, start, end))
                if captures.take_appended(prior):
                    raise Unsupported("it hands tensors to transformers' output collector")
                if tiles.calls != 1:
                    raise Unsupported(f"it called attention {tiles.calls} times in a tile")
                y = _hidden_out(result, tile)
            except Unsupported:
                _restore_rng(tiles.replays[0])
                raise
            if out is None:
                first, out = result, y.new_empty(*y.shape[:1], seq, *y.shape[2:])
            out[:, start:end] = y
    leaves_out, out_spec = pytree.tree_flatten(first)
    leaves_out = [out if isinstance(v, torch.Tensor) else v for v in leaves_out]
    return pytree.tree_unflatten(leaves_out, out_spec), tiles.replays


def backward(original: Callable[..., Any], hidden: torch.Tensor, kwargs: dict[str, Any],
             grad_out: torch.Tensor | None, params: list[torch.nn.Parameter], *,
             block_tokens: int, configs: list[Any], replays: list[ReplayState],
             hidden_grad: bool, reuse_grad: bool = False
             ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The gradients of the layer's input (when `hidden_grad`) and of `params` for the
    output gradient `grad_out`, the tiles re-run as `forward` ran them (`replays`). With
    `reuse_grad` (`grad_out` is the engine's own, shaped as `hidden`) each tile's input
    gradient overwrites its slice of `grad_out` once the tile has read it, and `grad_out`
    is returned as the input gradient: one [batch, S, hidden] tensor instead of two."""
    seq = hidden.shape[1]
    bounds = _bounds(seq, block_tokens)
    param_grads: list[torch.Tensor | None] = [None] * len(params)
    if grad_out is None:
        return None, param_grads
    leaves, spec, cuts = _cutters(kwargs, seq)
    tiles = _Tiles(mode="keys", seq=seq)
    grad_hidden = None
    if hidden_grad:
        grad_hidden = grad_out if reuse_grad else torch.zeros_like(hidden)
    with _dispatching(configs, tiles):
        for (start, end), replay in zip(bounds, replays, strict=True):
            tiles.begin(start, end)
            with replaying(replay), torch.no_grad():
                try:
                    original(hidden[:, start:end], **_tile_kwargs(leaves, spec, cuts, start, end))
                except _KeysDone:
                    continue
            raise RuntimeError("a sequence-tiled layer's re-run did not reach its attention")
        tiles.mode = "grad"
        for (start, end), replay in reversed(list(zip(bounds, replays, strict=True))):
            tiles.begin(start, end)
            with replaying(replay), torch.enable_grad():
                x = hidden[:, start:end].detach().requires_grad_(hidden_grad)
                y = _hidden_out(original(x, **_tile_kwargs(leaves, spec, cuts, start, end)), x)
                inputs = ([x] if hidden_grad else []) + list(params)
                if not y.requires_grad or not inputs:
                    continue
                got = list(torch.autograd.grad(y, inputs, grad_out[:, start:end],
                                               allow_unused=True))
            if hidden_grad:
                g = got.pop(0)
                if g is not None:
                    grad_hidden[:, start:end] = g
                elif reuse_grad:
                    grad_hidden[:, start:end] = 0
            for k, g in enumerate(got):
                if g is None:
                    continue
                if param_grads[k] is None:
                    param_grads[k] = g.float() if g.element_size() < 4 else g
                else:
                    param_grads[k].add_(g)
    param_grads = [g if g is None else g.to(p.dtype)
                   for g, p in zip(param_grads, params, strict=True)]
    return grad_hidden, param_grads


def can_reuse(grad_out: torch.Tensor | None, hidden: torch.Tensor) -> bool:
    """Whether `grad_out` has the layout `backward(reuse_grad=True)` writes into."""
    return (grad_out is not None and grad_out.shape == hidden.shape
            and grad_out.dtype == hidden.dtype and grad_out.is_contiguous())


class OwnedGrad(torch.autograd.Function):
    """Identity on the last layer's output whose backward hands the layer a gradient no
    other node holds (a copy, made before that layer's working set exists), so it may be
    overwritten in place (`backward(reuse_grad=True)`); `own` registers it."""

    @staticmethod
    def forward(ctx: Any, own: Callable[[torch.Tensor], None], x: torch.Tensor) -> torch.Tensor:
        ctx.own = own
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, torch.Tensor | None]:
        if grad is None:
            return None, None
        mine = grad.clone(memory_format=torch.contiguous_format)
        ctx.own(mine)
        return None, mine


def _row_blocks(tiles: _Tiles, device: torch.device) -> list[tuple[int, int, int]]:
    """(first row, end row, end key) of each SDPA call of the running tile: one on CUDA,
    row blocks of at most `MASK_ELEMS` mask elements elsewhere. Row r of the tile is
    position start + r and attends keys [0, start + r + 1)."""
    rows = tiles.end - tiles.start
    step = rows if device.type == "cuda" else max(1, MASK_ELEMS // tiles.end)
    return [(r, min(r + step, rows), tiles.start + min(r + step, rows))
            for r in range(0, rows, step)]


def _mask_rows(mask: torch.Tensor | None, r0: int, r1: int, keys: int) -> torch.Tensor | None:
    return None if mask is None else mask[..., r0:r1, :keys]


def _attend(tiles: _Tiles, query: torch.Tensor, mask: torch.Tensor | None,
            scale: float | None) -> torch.Tensor:
    """The running tile's attention output (no graph): its queries against the K, V prefix."""
    out = query.new_empty(*query.shape[:3], tiles.value.shape[-1])
    for r0, r1, keys in _row_blocks(tiles, query.device):
        out[:, :, r0:r1] = block_attention(query[:, :, r0:r1], tiles.key[:, :, :keys],
                                           tiles.value[:, :, :keys],
                                           _mask_rows(mask, r0, r1, keys), scale)
    return out


class _TileAttention(torch.autograd.Function):
    """One tile's queries against the key prefix [0, end) held in the K, V buffers; its
    backward accumulates the prefix's dK, dV and returns the tile's own rows."""

    @staticmethod
    def forward(ctx: Any, tiles: _Tiles, mask: torch.Tensor | None, scale: float | None,
                query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = _attend(tiles, query, mask, scale)
        ctx.tiles, ctx.bounds, ctx.mask, ctx.scale = tiles, (tiles.start, tiles.end), mask, scale
        ctx.dtypes = (key.dtype, value.dtype)
        ctx.save_for_backward(query)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Re-runs SDPA with grad one kv head (and its query heads) at a time: a GQA
        flash backward expands dK, dV of the key prefix to every query head before it
        sums them (4x K, V's bytes for llama3-8b: 32 GiB at 2M tokens); per kv head the
        partials and that expansion are one kv head's."""
        tiles: _Tiles = ctx.tiles
        start, end = ctx.bounds
        (query,) = ctx.saved_tensors
        if tiles.grad_key is None:
            tiles.grad_key = torch.zeros(tiles.key.shape, dtype=torch.float32,
                                         device=tiles.key.device)
            tiles.grad_value = torch.zeros(tiles.value.shape, dtype=torch.float32,
                                           device=tiles.value.device)
        grad_q = torch.empty_like(query)
        heads, kv_heads = query.shape[1], tiles.key.shape[1]
        group = heads // kv_heads
        for r0, r1, keys in _row_blocks(tiles, query.device):
            mask = _mask_rows(ctx.mask, r0, r1, keys)
            for j in range(kv_heads):  # one kv head at a time (see `backward` below)
                h0, h1 = j * group, (j + 1) * group
                q = query[:, h0:h1, r0:r1].detach().requires_grad_()
                k = tiles.key[:, j:j + 1, :keys].detach().requires_grad_()
                v = tiles.value[:, j:j + 1, :keys].detach().requires_grad_()
                head_mask = mask if mask is None or mask.shape[1] == 1 else mask[:, h0:h1]
                with torch.enable_grad():
                    out = block_attention(q, k, v, head_mask, ctx.scale)
                gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad_out[:, h0:h1, r0:r1])
                grad_q[:, h0:h1, r0:r1] = gq
                tiles.grad_key[:, j:j + 1, :keys] += gk
                tiles.grad_value[:, j:j + 1, :keys] += gv
                del out, gq, gk, gv
        own_k = tiles.grad_key[:, :, start:end].to(ctx.dtypes[0])
        own_v = tiles.grad_value[:, :, start:end].to(ctx.dtypes[1])
        return None, None, None, grad_q, own_k, own_v


def tiled_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """`LAYER_TILES_ATTENTION`: transformers' attention-function signature; the running
    tile's queries against the keys of every tile so far (SDPA's math)."""
    tiles = _running.get()
    if tiles is None:  # called outside a tiled layer run: stock
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    refuse_unsupported("sequence-tiled", dropout, kwargs)
    tiles.calls += 1
    length = tiles.end - tiles.start
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if query.shape[2] != length or key.shape[2] != length:
        raise Unsupported(f"its attention got {key.shape[2]} keys for a tile of {length}")
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[-1] != tiles.seq:
            raise Unsupported(f"its attention mask {tuple(attention_mask.shape)} is not "
                              "[batch, heads, tile, S]")
        mask = attention_mask[..., :tiles.end]
    elif not causal:
        raise Unsupported("its attention is not causal")
    tiles.store(key, value)
    if tiles.mode == "keys":
        raise _KeysDone
    if tiles.mode == "forward":
        out = _attend(tiles, query, mask, scaling)
    else:
        out = _TileAttention.apply(tiles, mask, scaling, query, key, value)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(LAYER_TILES_ATTENTION, tiled_attention_forward)
