"""The geometry of a model in hand, read from its live modules (no per-family table).

`prepare` and the Trainer hold the model itself, so parameter counts come from its
parameters: per decoder layer, resident (embeddings, final norm, head), tied or not. The
config supplies only shapes the parameters cannot say unambiguously (attention heads,
head dim, the MLP width the working-set estimate uses). Mixture-of-experts layers stream
every expert's weights but compute with `top_k` of them per token: `active_layer_param_count`
counts the parameters a token's FLOPs go through. The config-based table in `families.py`
stays for presets and `config.json` paths, where no model exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lazytrain_accel.profiling.profile import QUANTIZED_FORMATS, ModelGeometry, WeightSplit
from lazytrain_accel.profiling.whole_layers import EXPERTS_KEYS, whole_layer_reason

#: Config keys naming the same shape across HF families, most common first.
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                      "moe_intermediate_size")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
_EXPERTS_KEYS = EXPERTS_KEYS
#: Parameter-name parts that only gated MLPs (SwiGLU/GeGLU: gate, up, down) have.
_GATED_NAMES = ("gate_proj", "gate_up_proj", "up_proj", "w3")


#: torch dtype -> the storage format name of a frozen float weight.
_FLOAT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _quant_state_bytes(state: Any) -> int:
    """Bytes of a bitsandbytes 4-bit `QuantState`: absmax and code, and the nested
    state's when the absmax itself is quantized (double quantization)."""
    nbytes = sum(t.nbytes for t in (state.absmax, state.code, getattr(state, "offset", None))
                 if isinstance(t, torch.Tensor))
    nested = getattr(state, "state2", None)
    return nbytes + (_quant_state_bytes(nested) if nested is not None else 0)


def stored_param(p: torch.Tensor) -> tuple[int, int, int, str]:
    """(logical element count, stored bytes, of which scale bytes, format) of one
    parameter; bitsandbytes `Params4bit` / `Int8Params` are recognised by type name, so
    bitsandbytes is never imported here. A 4-bit weight not yet quantized (still on the
    meta device or in floats) counts as what it is now."""
    kind, nbytes = type(p).__name__, p.numel() * p.element_size()
    state = getattr(p, "quant_state", None)
    if kind == "Params4bit" and state is not None:
        scales = _quant_state_bytes(state)
        return int(torch.Size(state.shape).numel()), nbytes + scales, scales, \
            str(state.quant_type)
    scb = getattr(p, "SCB", None)
    if kind == "Int8Params" and p.dtype == torch.int8:
        scales = scb.nbytes if isinstance(scb, torch.Tensor) else 0
        return p.numel(), nbytes + scales, scales, "int8"
    return p.numel(), nbytes, 0, _FLOAT_FORMATS.get(p.dtype, "fp32")


def _first(config: Any, keys: Sequence[str]) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return None


def _expert_fraction(config: Any) -> float:
    """top_k / experts: the share of expert weights one token computes with (1 if dense)."""
    top_k, experts = _first(config, _TOP_K_KEYS), _first(config, _EXPERTS_KEYS)
    if isinstance(top_k, int) and isinstance(experts, int) and 0 < top_k <= experts:
        return top_k / experts
    return 1.0


def _layer_counts(layer: nn.Module, fraction: float) -> tuple[int, float, bool]:
    """(parameters, active parameters, gated MLP) of one decoder layer."""
    total, experts, gated = 0, 0, False
    for name, p in layer.named_parameters():
        numel = stored_param(p)[0]
        total += numel
        parts = name.split(".")
        if "experts" in parts:
            experts += numel
        gated = gated or any(g in parts for g in _GATED_NAMES)
    return total, total - experts + experts * fraction, gated


def _resident_split(model: nn.Module, layer_ids: set[int]) -> tuple[int, int, int, bool]:
    """(embedding, head, other resident) parameter counts outside the layers, and tied."""
    seen: set[int] = set(layer_ids)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = (emb is not None and head is not None
            and getattr(head, "weight", None) is getattr(emb, "weight", object()))

    def count(module: nn.Module | None) -> int:
        n = 0
        for p in module.parameters() if module is not None else ():
            if id(p) not in seen:
                seen.add(id(p))
                n += stored_param(p)[0]
        return n

    embedding, head_count = count(emb), count(head)
    rest = 0
    for p in model.parameters():  # positions, final norm, projections: resident too
        if id(p) not in seen:
            seen.add(id(p))
            rest += stored_param(p)[0]
    return embedding, head_count, rest, tied


def _require(config: Any, keys: Sequence[str], what: str) -> int:
    value = _first(config, keys)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"the model's config has no {what} ({' / '.join(keys)}); LazyTrain "
                         "needs it to size the boundaries and attention FLOPs")
    return value


def geometry_from_model(model: nn.Module, layers: Sequence[nn.Module]) -> ModelGeometry:
    """The `ModelGeometry` of `model`, whose decoder layers are `layers`, from its modules."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        raise TypeError(f"{type(model).__name__} has no HF `config`: LazyTrain streams "
                        "HuggingFace decoder-only causal LMs (PreTrainedModel)")
    fraction = _expert_fraction(config)
    counts = [_layer_counts(layer, fraction) for layer in layers]
    layer_ids = {id(p) for layer in layers for p in layer.parameters()}
    embedding, head, rest, tied = _resident_split(model, layer_ids)
    hidden = _require(config, _HIDDEN_KEYS, "hidden size")
    heads = _require(config, _HEADS_KEYS, "attention head count")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = _first(config, _KV_HEADS_KEYS) or (1 if getattr(config, "multi_query", False)
                                                  else heads)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = (out.weight.shape[0] if out is not None and hasattr(out, "weight")
             else _require(config, ("vocab_size",), "vocabulary size"))
    return ModelGeometry(
        name=str(getattr(config, "name_or_path", "") or type(model).__name__),
        family=str(getattr(config, "model_type", "") or type(model).__name__),
        num_layers=len(layers),
        hidden_size=hidden,
        intermediate_size=int(_first(config, _INTERMEDIATE_KEYS) or 4 * hidden),
        num_attention_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(vocab),
        tied_embeddings=tied,
        layer_param_count=max(c[0] for c in counts),
        active_layer_param_count=(None if fraction == 1.0
                                  else round(max(c[1] for c in counts))),
        embedding_param_count=embedding,
        head_param_count=head,
        final_norm_param_count=rest,
        gated_mlp=any(c[2] for c in counts),
        whole_layer_reason=whole_layer_reason(config),
    )


@dataclass
class _Tally:
    """Running sums over parameters for a `WeightSplit` (elements and bytes)."""

    trainable: int = 0
    frozen: int = 0
    stored_bytes: int = 0
    packed: int = 0
    packed_bytes: int = 0
    scale_bytes: int = 0
    widest_packed: int = 0

    def add(self, p: torch.Tensor, formats: dict[str, int]) -> None:
        numel, nbytes, scale_bytes, fmt = stored_param(p)
        if p.requires_grad:
            self.trainable += numel
            return
        formats[fmt] = formats.get(fmt, 0) + numel
        self.frozen, self.stored_bytes = self.frozen + numel, self.stored_bytes + nbytes
        if fmt in QUANTIZED_FORMATS:
            self.packed, self.packed_bytes = self.packed + numel, self.packed_bytes + nbytes
            self.scale_bytes += scale_bytes
            self.widest_packed = max(self.widest_packed, numel)


def _tally(params: Iterable[torch.Tensor], formats: dict[str, int]) -> _Tally:
    tally = _Tally()
    for p in params:
        tally.add(p, formats)
    return tally


def weight_split_from_model(model: nn.Module, layers: Sequence[nn.Module]
                            ) -> WeightSplit | None:
    """Trainable vs frozen parameters of `model` (decoder layers `layers`) and how the
    frozen ones are stored; None when every parameter trains (a full fine-tune, priced
    as before). The largest layer stands for all of them, as in `geometry_from_model`."""
    formats: dict[str, int] = {}
    per_layer = [_tally(layer.parameters(), formats) for layer in layers]
    layer_ids = {id(p) for layer in layers for p in layer.parameters()}
    resident = _tally((p for p in {id(p): p for p in model.parameters()}.values()
                       if id(p) not in layer_ids), formats)
    if not formats:
        return None
    big = max(per_layer, key=lambda t: t.trainable + t.frozen, default=_Tally())
    return WeightSplit(
        layer_trainable_param_count=big.trainable, layer_frozen_param_count=big.frozen,
        layer_frozen_host_bytes=big.stored_bytes, layer_packed_param_count=big.packed,
        layer_packed_bytes=big.packed_bytes, layer_frozen_scale_bytes=big.scale_bytes,
        layer_dequant_elems=big.widest_packed,
        resident_trainable_param_count=resident.trainable,
        resident_frozen_param_count=resident.frozen,
        resident_frozen_host_bytes=resident.stored_bytes,
        frozen_format=max(formats, key=formats.__getitem__))
