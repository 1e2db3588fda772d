"""`frozen_weights="nf4"|"fp4"|"int8"`: quantize a frozen bf16/fp32 base at `prepare`.

For users who loaded full-precision weights and froze them (LoRA): every `nn.Linear` of
the decoder layers whose weight is frozen becomes bitsandbytes' own module (`Linear4bit`
or `Linear8bitLt`) holding the weight packed, as
`from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` would have loaded it
(no double quantization, bitsandbytes' defaults otherwise; the head, embeddings, norms
and every trainable linear stay as they are). A PEFT LoRA layer keeps its adapters and
calls the new module as its `base_layer`. The packed weights then stream as stored
(`engine/memory/quantized.py`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lazytrain_accel.engine.model.discovery import find_decoder_layers

logger = logging.getLogger("lazytrain_accel")

#: The `LazyTrainConfig.frozen_weights` values that quantize (besides "keep").
QUANTIZE_FORMATS = ("nf4", "fp4", "int8")


def _packed_linear(linear: nn.Linear, fmt: str, compute_dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb

    weight = linear.weight.data.to("cpu", torch.float32)
    bias = linear.bias is not None
    if fmt == "int8":
        module = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias,
                                     has_fp16_weights=False)
        module.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        module = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias,
                                   compute_dtype=compute_dtype, quant_type=fmt,
                                   compress_statistics=False)
        module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=fmt,
                                          compress_statistics=False)
    if bias:
        module.bias = nn.Parameter(linear.bias.data.clone(),
                                   requires_grad=linear.bias.requires_grad)
    return module.to("cpu")  # quantizes (bitsandbytes packs on the move to a device)


def quantize_frozen_linears(model: nn.Module, fmt: str,
                            compute_dtype: torch.dtype = torch.float32) -> int:
    """Replace the frozen linears of `model`'s decoder layers by packed bitsandbytes ones
    (`fmt` in `QUANTIZE_FORMATS`); returns how many were replaced."""
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"frozen_weights={fmt!r}: expected 'keep' or one of "
                         f"{list(QUANTIZE_FORMATS)}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(f"frozen_weights={fmt!r} needs bitsandbytes: pip install "
                         "bitsandbytes, or use frozen_weights='keep'") from None
    replaced = 0
    for layer in find_decoder_layers(model)[2]:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and not child.weight.requires_grad:
                    setattr(parent, name, _packed_linear(child, fmt, compute_dtype))
                    replaced += 1
    logger.info("lazytrain: frozen_weights=%s quantized %d frozen decoder linears with "
                "bitsandbytes (they stream packed)", fmt, replaced)
    return replaced
