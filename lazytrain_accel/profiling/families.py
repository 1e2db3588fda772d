"""Exact parameter counts of HF decoder-only families, from a raw `config.json` dict.

Each family's counter mirrors the modules transformers instantiates (which linears carry a
bias, how many norms a layer has, whether norms have a bias), so that
`ModelGeometry.total_param_count == sum(p.numel() for p in model.parameters())` for the
model built from the same config (tied weights counted once). The tests check this by
instantiating tiny configs of every family.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lazytrain_accel.profiling.profile import ModelGeometry
from lazytrain_accel.profiling.whole_layers import whole_layer_reason


@dataclass(kw_only=True, frozen=True)
class _Counts:
    """Parameter counts of one family instance before they become a `ModelGeometry`."""

    layer: int
    embedding: int
    head_untied: int  # lm_head as if untied; dropped when the embeddings are tied
    final_norm: int
    intermediate_size: int
    gated_mlp: bool
    active_layer: int | None = None  # MoE: parameters one token computes with (top-k)


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """First non-None value among `keys` (HF configs name the same thing differently)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _require(config: dict[str, Any], *keys: str) -> int:
    value = _get(config, *keys)
    if value is None:
        raise ValueError(
            f"model config of type {config.get('model_type')!r} has no {' / '.join(keys)}; "
            "pass the model's full HF config.json"
        )
    return int(value)


def _heads(config: dict[str, Any], hidden: int) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head dim)."""
    heads = _require(config, "num_attention_heads", "n_head")
    kv_heads = int(_get(config, "num_key_value_heads", default=heads))
    head_dim = int(_get(config, "head_dim", default=hidden // heads))
    return heads, kv_heads, head_dim


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _llama_style(
    config: dict[str, Any],
    *,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool = False,
    norms_per_layer: int = 2,
    qk_norm: bool = False,
) -> _Counts:
    """Llama and its descendants: q/k/v/o projections, gated MLP, weight-only RMSNorms."""
    hidden = _require(config, "hidden_size")
    inter = _require(config, "intermediate_size")
    heads, kv_heads, head_dim = _heads(config, hidden)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attention = (_linear(hidden, q_dim, qkv_bias) + 2 * _linear(hidden, kv_dim, qkv_bias)
                 + _linear(q_dim, hidden, o_bias) + (2 * head_dim if qk_norm else 0))
    mlp = 2 * _linear(hidden, inter, mlp_bias) + _linear(inter, hidden, mlp_bias)
    vocab = _require(config, "vocab_size")
    return _Counts(layer=attention + mlp + norms_per_layer * hidden, embedding=vocab * hidden,
                   head_untied=vocab * hidden, final_norm=hidden, intermediate_size=inter,
                   gated_mlp=True)


def _llama(config: dict[str, Any]) -> _Counts:
    bias = bool(config.get("attention_bias", False))
    return _llama_style(config, qkv_bias=bias, o_bias=bias,
                        mlp_bias=bool(config.get("mlp_bias", False)))


def _qwen2(config: dict[str, Any]) -> _Counts:
    return _llama_style(config, qkv_bias=True, o_bias=False)


def _qwen3(config: dict[str, Any]) -> _Counts:
    bias = bool(config.get("attention_bias", False))
    return _llama_style(config, qkv_bias=bias, o_bias=bias, qk_norm=True)


def _mistral(config: dict[str, Any]) -> _Counts:
    return _llama_style(config, qkv_bias=False, o_bias=False)


def _gemma(config: dict[str, Any]) -> _Counts:
    bias = bool(config.get("attention_bias", False))
    return _llama_style(config, qkv_bias=bias, o_bias=bias)


def _gemma2(config: dict[str, Any]) -> _Counts:
    # Gemma 2 adds a pre- and post-feedforward norm to every layer.
    bias = bool(config.get("attention_bias", False))
    return _llama_style(config, qkv_bias=bias, o_bias=bias, norms_per_layer=4)


def _phi3(config: dict[str, Any]) -> _Counts:
    """Phi-3: fused qkv_proj and gate_up_proj, no biases; same count as Llama without bias."""
    return _llama_style(config, qkv_bias=False, o_bias=False)


def _gpt_neox(config: dict[str, Any]) -> _Counts:
    hidden = _require(config, "hidden_size")
    inter = _require(config, "intermediate_size")
    bias = bool(config.get("attention_bias", True))
    attention = _linear(hidden, 3 * hidden, bias) + _linear(hidden, hidden, bias)
    mlp = _linear(hidden, inter, True) + _linear(inter, hidden, True)
    vocab = _require(config, "vocab_size")
    return _Counts(layer=attention + mlp + 2 * 2 * hidden, embedding=vocab * hidden,
                   head_untied=vocab * hidden, final_norm=2 * hidden, intermediate_size=inter,
                   gated_mlp=False)


def _gpt2(config: dict[str, Any]) -> _Counts:
    hidden = _require(config, "n_embd", "hidden_size")
    inter = int(_get(config, "n_inner", default=4 * hidden))
    attention = _linear(hidden, 3 * hidden, True) + _linear(hidden, hidden, True)
    mlp = _linear(hidden, inter, True) + _linear(inter, hidden, True)
    vocab = _require(config, "vocab_size")
    positions = _require(config, "n_positions", "max_position_embeddings")
    return _Counts(layer=attention + mlp + 2 * 2 * hidden,
                   embedding=(vocab + positions) * hidden, head_untied=vocab * hidden,
                   final_norm=2 * hidden, intermediate_size=inter, gated_mlp=False)


def _opt(config: dict[str, Any]) -> _Counts:
    hidden = _require(config, "hidden_size")
    inter = _require(config, "ffn_dim")
    bias = bool(config.get("enable_bias", True))
    norm = 2 * hidden if config.get("layer_norm_elementwise_affine", True) else 0
    layer = (4 * _linear(hidden, hidden, bias) + _linear(hidden, inter, bias)
             + _linear(inter, hidden, bias) + 2 * norm)
    vocab = _require(config, "vocab_size")
    word_dim = int(_get(config, "word_embed_proj_dim", default=hidden))
    # OPT's learned positions are offset by 2 rows; project_in/out exist when the word
    # embedding is narrower than the model (OPT-350m). project_out is counted with the
    # final norm: both sit between the last layer and the head.
    projection = hidden * word_dim if word_dim != hidden else 0
    positions = _require(config, "max_position_embeddings") + 2
    has_final_norm = (config.get("do_layer_norm_before", True)
                      and not config.get("_remove_final_layer_norm", False))
    return _Counts(layer=layer, embedding=vocab * word_dim + positions * hidden + projection,
                   head_untied=vocab * word_dim,
                   final_norm=(norm if has_final_norm else 0) + projection,
                   intermediate_size=inter, gated_mlp=False)


def _moe(config: dict[str, Any], *, inter_key: str, qk_norm: bool) -> _Counts:
    """Mixtral / Qwen3-MoE: Llama attention, a router (experts x hidden, no bias) and
    fused experts of gate+up and down matrices; a token runs through top_k experts."""
    hidden = _require(config, "hidden_size")
    # transformers 5 writes num_local_experts; older Qwen MoE config.json files num_experts
    experts = _require(config, "num_local_experts", "num_experts")
    top_k = _require(config, "num_experts_per_tok")
    inter = _require(config, inter_key)
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        warnings.warn("an MoE config with dense layers (mlp_only_layers / decoder_sparse_step) "
                      "is counted as if every layer were sparse; counts are approximate",
                      stacklevel=3)
    bias = bool(config.get("attention_bias", False))
    dense = _llama_style({**config, "intermediate_size": 0}, qkv_bias=bias, o_bias=bias,
                         qk_norm=qk_norm)
    expert_params = experts * 3 * hidden * inter
    layer = dense.layer + experts * hidden + expert_params
    return dataclasses.replace(dense, layer=layer, intermediate_size=inter,
                               active_layer=round(layer - expert_params
                                                  + expert_params * top_k / experts))


def _mixtral(config: dict[str, Any]) -> _Counts:
    return _moe(config, inter_key="intermediate_size", qk_norm=False)


def _qwen3_moe(config: dict[str, Any]) -> _Counts:
    return _moe(config, inter_key="moe_intermediate_size", qk_norm=True)


#: HF `model_type` -> counter. Unknown types with Llama-style keys fall back to `_llama`.
FAMILIES: dict[str, Callable[[dict[str, Any]], _Counts]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "phi3": _phi3,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
}

#: Whether the input embedding and lm_head share weights when config.json does not say.
_TIED_BY_DEFAULT = {"gemma", "gemma2", "opt", "gpt2"}


def geometry_from_config(config: dict[str, Any], name: str = "") -> ModelGeometry:
    """The `ModelGeometry` of the decoder-only LM that `config` (a HF config dict) describes.

    Multimodal configs are read through their `text_config`. Families outside `FAMILIES`
    are counted as Llama-style with a warning (the count is then approximate).
    """
    if isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "tie_word_embeddings":
                  config.get("tie_word_embeddings", config["text_config"].get(
                      "tie_word_embeddings"))}
    family = str(config.get("model_type", ""))
    counter = FAMILIES.get(family)
    if counter is None:
        if not all(k in config for k in ("hidden_size", "intermediate_size", "vocab_size")):
            raise ValueError(
                f"model_type={family!r} is not a supported decoder-only family "
                f"(supported: {sorted(FAMILIES)}) and its config lacks the Llama-style keys "
                "hidden_size / intermediate_size / vocab_size needed for an estimate"
            )
        warnings.warn(f"model_type={family!r} is not one of {sorted(FAMILIES)}: counting it "
                      "as a Llama-style model; parameter counts are approximate", stacklevel=2)
        counter = _llama
    counts = counter(config)
    hidden = _require(config, "hidden_size", "n_embd")
    heads, kv_heads, head_dim = _heads(config, hidden)
    tied = bool(_get(config, "tie_word_embeddings", default=family in _TIED_BY_DEFAULT))
    return ModelGeometry(
        name=name or str(config.get("_name_or_path") or family),
        family=family,
        num_layers=_require(config, "num_hidden_layers", "n_layer"),
        hidden_size=hidden,
        intermediate_size=counts.intermediate_size,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_require(config, "vocab_size"),
        tied_embeddings=tied,
        layer_param_count=counts.layer,
        embedding_param_count=counts.embedding,
        head_param_count=0 if tied else counts.head_untied,
        final_norm_param_count=counts.final_norm,
        gated_mlp=counts.gated_mlp,
        active_layer_param_count=counts.active_layer,
        whole_layer_reason=whole_layer_reason(config),
    )
