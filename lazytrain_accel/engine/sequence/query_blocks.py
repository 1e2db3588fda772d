"""Attention in query blocks inside a streamed layer (a layer that cannot run in tiles).

While such a layer runs, its attention modules' configs name `QUERY_BLOCKS_ATTENTION`:
SDPA once per block of queries [a, b) against keys [0, b), causal with the diagonal
offset by a (never an S x S mask; a 4-D mask, where one is left, is sliced per block).
`_BlockedAttention` keeps only q, k, v: its backward re-runs each block with grad, writes
dQ into the block's slice and sums dK, dV in fp32, so SDPA's backward buffers exist for
one block at a time (q, o, dO, dQ of the whole sequence still do). Only SDPA is blocked:
another attention implementation, attention dropout, soft-capping, a position bias or
sinks are refused. Design: docs/engine.md "Long context" (**Attention in query blocks**).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lazytrain_accel.engine.sequence.attention import (
    QueryBlockError,
    block_attention,
    refuse_unsupported,
)

#: The attention implementation name streamed layers run under with query blocks.
QUERY_BLOCKS_ATTENTION = "lazytrain_query_blocks"
#: The only implementation query blocks replace.
BLOCKED_IMPLEMENTATION = "sdpa"


_block_tokens: ContextVar[int] = ContextVar("lazytrain_attention_block_tokens", default=0)


def attention_configs(layer: nn.Module) -> list[Any]:
    """The distinct configs the layer's attention modules dispatch on (those carrying an
    `_attn_implementation`)."""
    found: dict[int, Any] = {}
    for module in layer.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") \
                and any(isinstance(v, nn.Linear) for v in module.children()):
            found.setdefault(id(config), config)
    return list(found.values())


def check_layers(layers: list[nn.Module], block_tokens: int) -> list[list[Any]]:
    """Each layer's attention configs; refuses (`QueryBlockError`) when `block_tokens` > 0
    and a layer's attention is not one SDPA call the engine can block."""
    configs = [attention_configs(layer) for layer in layers]
    if block_tokens <= 0:
        return configs
    for index, (layer, found) in enumerate(zip(layers, configs, strict=True), start=1):
        names = sorted({str(c._attn_implementation) for c in found})
        if names != [BLOCKED_IMPLEMENTATION]:
            raise QueryBlockError(
                f"the plan runs attention in query blocks of {block_tokens} tokens, but "
                f"decoder layer {index} ({type(layer).__name__}) dispatches attention through "
                f"{names or 'no transformers attention interface'}: load the model with "
                "attn_implementation='sdpa', or plan with tiling 'none' or 'mlp' (whole-"
                "sequence attention; fewer tokens per step then fit)")
    return configs


@contextmanager
def query_blocks(configs: list[Any], block_tokens: int) -> Iterator[None]:
    """Run the body with the attention of `configs` in query blocks of `block_tokens`
    (nothing when 0); the configs' implementation is restored after."""
    if block_tokens <= 0:
        yield
        return
    token = _block_tokens.set(block_tokens)
    for config in configs:
        config._attn_implementation = QUERY_BLOCKS_ATTENTION
    try:
        yield
    finally:
        for config in configs:
            config._attn_implementation = BLOCKED_IMPLEMENTATION
        _block_tokens.reset(token)


def _mask_rows(mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if mask is None else mask[..., start:end, :end]


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block_tokens: int, scale: float | None, mask: torch.Tensor | None,
                query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        seq = query.shape[2]
        bounds = [(a, min(a + block_tokens, seq)) for a in range(0, seq, block_tokens)]
        out = query.new_empty(*query.shape[:3], value.shape[-1])  # [batch, heads, S, d_v]
        for start, end in bounds:
            out[:, :, start:end] = block_attention(
                query[:, :, start:end], key[:, :, :end], value[:, :, :end],
                _mask_rows(mask, start, end), scale)
        ctx.bounds, ctx.scale, ctx.mask = bounds, scale, mask
        ctx.save_for_backward(query, key, value)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value = ctx.saved_tensors
        grad_q = torch.empty_like(query)
        grad_k = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        grad_v = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for start, end in ctx.bounds:
            q = query[:, :, start:end].detach().requires_grad_()
            k = key[:, :, :end].detach().requires_grad_()
            v = value[:, :, :end].detach().requires_grad_()
            with torch.enable_grad():
                out = block_attention(q, k, v, _mask_rows(ctx.mask, start, end), ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad_out[:, :, start:end])
            grad_q[:, :, start:end] = gq
            grad_k[:, :, :end] += gk
            grad_v[:, :, :end] += gv
        return (None, None, None, grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype))


def blocked_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs: Any
                              ) -> tuple[torch.Tensor, None]:
    """`QUERY_BLOCKS_ATTENTION`: transformers' attention-function signature, SDPA's math,
    the queries in blocks of the running layer's `attention_block_tokens`."""
    block = _block_tokens.get()
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    seq = query.shape[2]
    if block <= 0 or seq <= block or key.shape[2] != seq or not (causal or attention_mask
                                                                  is not None):
        return sdpa_attention_forward(  # one block, a cache, or no causal structure: stock
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs)
    refuse_unsupported("query-blocked", dropout, kwargs)
    out = _BlockedAttention.apply(block, scaling, attention_mask, query, key, value)
    return out.transpose(1, 2).contiguous(), None

AttentionInterface.register(QUERY_BLOCKS_ATTENTION, blocked_attention_forward)
