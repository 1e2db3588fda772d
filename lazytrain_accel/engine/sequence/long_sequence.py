"""Attention at long sequence: no S x S mask or score matrix on the streamed path.

From `LONG_SEQ_TOKENS` tokens per sequence attention runs through SDPA's fused kernels
with `is_causal` and no mask. What would make the model build an S x S mask is refused
once per pass, on the decoder stack's inputs (`check_inputs`: eager attention, a padded
2-D mask, packed `position_ids` with no mask); at each layer call (`check_call`) eager
attention is refused, a plain causal 4-D mask dropped and any other refused, and a hidden
state of 2^31 elements or more refused unless the layer runs in sequence tiles. While such
a layer runs (`fused_attention`) SDPA's math backend is off, so a fallback to it raises a
`LongSequenceError` naming the cause instead of allocating S x S scores.
Design: docs/engine.md "Long context" (**Attention at long sequence**).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Tokens per sequence from which a layer call counts as long: an S x S fp32 mask or score
#: matrix is 256 MiB per sequence and head here, and grows as S^2.
LONG_SEQ_TOKENS = 8192
#: Elements from which kernels' int32 index math overflows.
INDEX_LIMIT_ELEMENTS = 2**31
_FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
_MASK_ROWS = 1024  # rows of a 4-D mask compared at a time (bounded extra memory)


class LongSequenceError(ValueError):
    """A long-sequence layer call would build an S x S tensor or overflow int32 indexing."""


def sequence_tokens(hidden: torch.Tensor) -> int:
    """Tokens per sequence of a [batch, seq, hidden] (or [seq, hidden]) hidden state."""
    return hidden.shape[-2] if hidden.dim() >= 2 else 1


def check_inputs(arguments: dict[str, Any], *, attn_implementation: str | None) -> None:
    """Refuse, before the decoder stack builds its masks, the inputs from which it would
    build an S x S one (see module doc); `arguments` are the stack's call arguments."""
    ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        seq = ids.shape[-1]
    elif isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        seq = embeds.shape[-2]
    else:
        return
    if seq < LONG_SEQ_TOKENS:
        return
    if attn_implementation == "eager":
        raise _eager_error(seq)
    mask, positions = arguments.get("attention_mask"), arguments.get("position_ids")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise LongSequenceError(
            f"a padded 2-D attention mask at {seq} tokens per sequence: transformers would "
            f"build a [batch, 1, {seq}, {seq}] mask from it. Train one unpadded sample per "
            "batch (batch 1, or TRL's padding_free=True) with an all-ones mask or none")
    if (mask is None and isinstance(positions, torch.Tensor) and positions.dim() >= 1
            and attn_implementation == "sdpa" and _restarts(positions)):
        raise LongSequenceError(
            f"position_ids restart inside a row of {seq} tokens (packed samples) and there is "
            f"no attention mask: transformers would build a block-diagonal [{seq}, {seq}] "
            "mask for sdpa attention. Train one sample per row (TRL: "
            "packing=False), or use attn_implementation='flash_attention_2' on a GPU, which "
            "takes the samples' boundaries from position_ids")


def _restarts(positions: torch.Tensor) -> bool:
    """Whether position ids stop counting up by one somewhere inside a row."""
    return bool((positions[..., 1:] - positions[..., :-1] != 1).any())


def check_call(hidden: torch.Tensor, kwargs: dict[str, Any], *, attn_implementation: str | None,
               verdicts: dict[tuple[int, int], bool], tiled: bool = False) -> None:
    """Refuse or fix a decoder-layer call at long sequence (in place on `kwargs`).
    `verdicts` caches, per mask tensor (id, version), whether it is plain causal: every
    layer of a pass gets the same mask. `tiled`: the layer runs in sequence tiles
    (`layer_tiles.py`), whose kernels see one tile of the hidden state, never all of it."""
    if hidden.numel() >= INDEX_LIMIT_ELEMENTS and not tiled:
        raise LongSequenceError(
            f"the hidden state {tuple(hidden.shape)} has {hidden.numel():,} elements, at or "
            f"past 2^31 ({INDEX_LIMIT_ELEMENTS:,}) where kernels' int32 indexing overflows: "
            "run the layers in sequence tiles (a plan with tiling 'layer': the "
            "planner's tile_tokens='auto' picks it), split the batch (batch 1) or train "
            "on shorter sequences")
    seq = sequence_tokens(hidden)
    if seq < LONG_SEQ_TOKENS:
        return
    if attn_implementation == "eager":
        raise _eager_error(seq)
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != seq:
        return
    key = (id(mask), mask._version)
    if key not in verdicts:
        verdicts[key] = _is_plain_causal(mask)
    if not verdicts[key]:
        raise LongSequenceError(
            f"the decoder layers got a 4-D attention mask {tuple(mask.shape)} that is not "
            f"plain causal (padding, a sliding window, packed samples) at {seq} tokens per "
            "sequence, where the engine builds no S x S mask: train one unpadded sample per "
            "batch with no attention_mask (or an all-ones one), set config.sliding_window="
            "None, or use shorter sequences")
    kwargs["attention_mask"] = None  # sdpa then runs `is_causal`


def _eager_error(seq: int) -> LongSequenceError:
    return LongSequenceError(
        f"eager attention at {seq} tokens per sequence materializes [batch, heads, {seq}, "
        f"{seq}] scores: load the model with attn_implementation='sdpa' (or "
        "'flash_attention_2' on a GPU)")


def _is_plain_causal(mask: torch.Tensor) -> bool:
    """Whether a [batch, heads, S, S] mask (bool: True attends; float: 0 attends) lets each
    query see exactly the keys at or before it; compared `_MASK_ROWS` rows at a time."""
    seq = mask.shape[-1]
    cols = torch.arange(seq, device=mask.device)
    for start in range(0, seq, _MASK_ROWS):
        block = mask[..., start:start + _MASK_ROWS, :]
        rows = torch.arange(start, start + block.shape[-2], device=mask.device)
        attends = block if block.dtype == torch.bool else block == 0
        if not torch.equal(attends, (cols[None, :] <= rows[:, None]).expand_as(attends)):
            return False
    return True


@contextmanager
def _without_math_backend(seq: int) -> Iterator[None]:
    try:
        with sdpa_kernel(_FUSED):
            yield
    except RuntimeError as err:
        if "No available kernel" not in str(err):
            raise
        raise LongSequenceError(
            f"at {seq} tokens per sequence no fused SDPA kernel accepts this attention call "
            "and the math fallback would build S x S scores: set the attention dropout to 0 "
            "(config.attention_dropout / attn_pdrop; a CPU's flash kernel takes no dropout) "
            "and use fp32, bf16 or fp16 (PyTorch's warnings above say which check failed)"
        ) from err


def fused_attention(hidden: torch.Tensor) -> Any:
    """Context for running a layer on `hidden`: at long sequence SDPA's math backend is off."""
    seq = sequence_tokens(hidden)
    return _without_math_backend(seq) if seq >= LONG_SEQ_TOKENS else nullcontext()
