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

from collections.abc import Sequence
from typing import Any

from torch import nn

from lazytrain_accel.profiling.model import ModelGeometry

#: Config keys naming the same shape across HF families, most common first.
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                      "moe_intermediate_size")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: Parameter-name parts that only gated MLPs (SwiGLU/GeGLU: gate, up, down) have.
_GATED_NAMES = ("gate_proj", "gate_up_proj", "up_proj", "w3")


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
        total += p.numel()
        parts = name.split(".")
        if "experts" in parts:
            experts += p.numel()
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
                n += p.numel()
        return n

    embedding, head_count = count(emb), count(head)
    rest = 0
    for p in model.parameters():  # positions, final norm, projections: resident too
        if id(p) not in seen:
            seen.add(id(p))
            rest += p.numel()
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
    )
