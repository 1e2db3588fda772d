"""SDPA over one block of queries against its key prefix: the attention math that query
blocks (`query_blocks.py`, a layer run whole) and sequence tiles (`layer_tiles.py`, the
layer run per tile) share, and what both refuse.

A block holds the queries [a, b) of a sequence and attends to the keys [0, b): causal with
the diagonal offset by a, as a chunked prefill does, so the block's output is final.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

#: Attention-function kwargs that change the math beyond a mask (refused when set).
UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")


class QueryBlockError(ValueError):
    """A plan asks for query-blocked attention where the engine cannot run it."""


def refuse_unsupported(kind: str, dropout: float, kwargs: dict[str, Any]) -> None:
    """Raise `QueryBlockError` when `kind` attention (query-blocked, sequence-tiled) got
    dropout or an argument that changes the math beyond a mask."""
    set_kwargs = [k for k in UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if dropout or set_kwargs:
        raise QueryBlockError(
            f"{kind} attention got dropout={dropout} and {set_kwargs or 'no'} "
            "unsupported arguments (logit soft-capping, a position bias, attention sinks): "
            "set the attention dropout to 0, or plan with tiling 'none' or 'mlp'")


def offset_causal(q_len: int, k_len: int, device: torch.device) -> Any:
    """Causal for the last `q_len` of `k_len` positions. On CUDA a `CausalBias` (a fused
    kernel applies it, nothing is built); elsewhere a [q_len, k_len] bool mask (PyTorch's
    `causal_lower_right` drops `enable_gqa` on that path)."""
    if device.type == "cuda":
        return causal_lower_right(q_len, k_len)
    rows = torch.arange(k_len - q_len, k_len, device=device)
    return torch.arange(k_len, device=device)[None, :] <= rows[:, None]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """One query block q ([batch, heads, block, d]) against the key prefix k, v ending with
    the block: causal with the diagonal at the bottom right, or `mask` (the block's rows)."""
    bias = mask if mask is not None else offset_causal(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
