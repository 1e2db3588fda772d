"""LoRA / QLoRA profiles before anything is loaded: adapters and a frozen, maybe packed, base.

`lazytrain plan --lora-rank R --frozen-format nf4` plans a QLoRA run from a config alone.
The frozen base's linear weights take the bytes bitsandbytes gives them (what
`from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` loads); norms, biases,
embeddings and the head stay in the compute dtype, as bitsandbytes leaves them. The
adapters (PEFT LoRA: A is r x in, B is out x r, per target linear) are the only trainable
parameters. A live model is read exactly instead (`live.weight_split_from_model`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from lazytrain_accel.profiling.profile import (
    FROZEN_FORMATS,
    QUANTIZED_FORMATS,
    ModelGeometry,
    WeightSplit,
)

#: bitsandbytes 4-bit: one fp32 absmax per block of this many weights (no double
#: quantization, `BitsAndBytesConfig`'s default; double quantization shrinks the scales
#: from 0.5 to ~0.13 bits per weight, so this is the conservative estimate).
BNB_4BIT_BLOCK = 64
#: Every linear of a decoder layer (PEFT's "all-linear", the QLoRA recipe).
ALL_LINEAR = "all-linear"
_FLOAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def layer_linears(g: ModelGeometry) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear of one decoder layer, by its Llama-style name
    (fused projections of other families have the same element counts)."""
    q_dim, kv_dim = g.num_attention_heads * g.head_dim, g.num_kv_heads * g.head_dim
    h, inter = g.hidden_size, g.intermediate_size
    linears = {"q_proj": (h, q_dim), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim),
               "o_proj": (q_dim, h), "up_proj": (h, inter), "down_proj": (inter, h)}
    if g.gated_mlp:
        linears["gate_proj"] = (h, inter)
    return linears


def stored_matrix_bytes(fmt: str, in_features: int, out_features: int) -> tuple[int, int]:
    """(bytes, of which scale bytes) of one linear weight stored as `fmt`: a dtype, LLM.int8
    (one int8 per weight, one fp32 scale per output row) or 4-bit (two weights per byte,
    one fp32 absmax per `BNB_4BIT_BLOCK` weights)."""
    n = in_features * out_features
    if fmt in _FLOAT_BYTES:
        return n * _FLOAT_BYTES[fmt], 0
    if fmt == "int8":
        return n + 4 * out_features, 4 * out_features
    if fmt in ("nf4", "fp4"):
        scales = 4 * math.ceil(n / BNB_4BIT_BLOCK)
        return math.ceil(n / 2) + scales, scales
    raise ValueError(f"frozen format {fmt!r}: expected one of {list(FROZEN_FORMATS)}")


def _targets(g: ModelGeometry, targets: Sequence[str]) -> list[str]:
    linears = layer_linears(g)
    names = list(linears) if ALL_LINEAR in targets else list(dict.fromkeys(targets))
    unknown = [t for t in names if t not in linears]
    if unknown or not names:
        raise ValueError(f"LoRA targets {unknown or list(targets)} are not linears of a "
                         f"{g.family} layer; choose among {sorted(linears)} or {ALL_LINEAR!r}")
    return names


def lora_profile_inputs(g: ModelGeometry, *, rank: int, targets: Sequence[str] = (ALL_LINEAR,),
                        frozen_format: str = "bf16", compute_bytes_per_elem: int = 2
                        ) -> tuple[ModelGeometry, WeightSplit]:
    """The geometry with rank-`rank` adapters on `targets` added to each layer, and its
    `WeightSplit`: adapters trainable, everything else frozen, linears stored as
    `frozen_format`, the other frozen parameters in the compute dtype when the linears
    are packed (else in `frozen_format` too)."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank={rank!r} must be a positive integer (PEFT's `r`)")
    if frozen_format not in FROZEN_FORMATS:
        raise ValueError(f"frozen format {frozen_format!r}: expected one of "
                         f"{list(FROZEN_FORMATS)}")
    linears = layer_linears(g)
    adapters = sum(rank * (linears[t][0] + linears[t][1]) for t in _targets(g, targets))
    matrices = sum(i * o for i, o in linears.values())
    other = max(g.layer_param_count - matrices, 0)  # norms, biases
    other_bytes = (compute_bytes_per_elem if frozen_format in QUANTIZED_FORMATS
                   else _FLOAT_BYTES[frozen_format])
    stored = [stored_matrix_bytes(frozen_format, i, o) for i, o in linears.values()]
    matrix_bytes, scale_bytes = sum(b for b, _ in stored), sum(s for _, s in stored)
    packed = frozen_format in QUANTIZED_FORMATS
    resident = g.total_param_count - g.num_layers * g.layer_param_count
    split = WeightSplit(
        layer_trainable_param_count=adapters,
        layer_frozen_param_count=matrices + other,
        layer_frozen_host_bytes=matrix_bytes + other * other_bytes,
        layer_packed_param_count=matrices if packed else 0,
        layer_packed_bytes=matrix_bytes if packed else 0,
        layer_frozen_scale_bytes=scale_bytes,
        layer_dequant_elems=max(i * o for i, o in linears.values()) if packed else 0,
        resident_trainable_param_count=0, resident_frozen_param_count=resident,
        resident_frozen_host_bytes=resident * other_bytes, frozen_format=frozen_format)
    active = g.active_layer_param_count
    adapted = dataclasses.replace(
        g, layer_param_count=matrices + other + adapters,
        active_layer_param_count=None if active is None else active + adapters)
    return adapted, split
