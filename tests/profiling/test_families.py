"""Analytic parameter counts equal `sum(p.numel())` of the instantiated HF model."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain_accel.profiling.families import FAMILIES
from lazytrain_accel.profiling.model_configs import geometry_from_config, load_model_config

_LLAMA_KEYS = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_TWO_MATRIX = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64)

CONFIGS = {
    "llama": T.LlamaConfig(**_LLAMA_KEYS),
    "llama-bias-tied": T.LlamaConfig(**_LLAMA_KEYS, attention_bias=True, mlp_bias=True,
                                     tie_word_embeddings=True),
    "qwen2": T.Qwen2Config(**_LLAMA_KEYS),
    "qwen3": T.Qwen3Config(**_LLAMA_KEYS, head_dim=16),
    "qwen3-bias": T.Qwen3Config(**_LLAMA_KEYS, head_dim=8, attention_bias=True),
    "mistral": T.MistralConfig(**_LLAMA_KEYS, head_dim=None),
    "gemma": T.GemmaConfig(**_LLAMA_KEYS, head_dim=16),
    "gemma2": T.Gemma2Config(**_LLAMA_KEYS, head_dim=16),
    "phi3": T.Phi3Config(**_LLAMA_KEYS, pad_token_id=0),
    "gpt_neox": T.GPTNeoXConfig(**_TWO_MATRIX, intermediate_size=48),
    "gpt_neox-nobias": T.GPTNeoXConfig(**_TWO_MATRIX, intermediate_size=48,
                                       attention_bias=False),
    "opt": T.OPTConfig(**_TWO_MATRIX, ffn_dim=48, pad_token_id=1),
    "opt-projected-postnorm": T.OPTConfig(**_TWO_MATRIX, ffn_dim=48, pad_token_id=1,
                                          word_embed_proj_dim=16, do_layer_norm_before=False),
    "gpt2": T.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "mixtral": T.MixtralConfig(**_LLAMA_KEYS, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": T.Qwen3MoeConfig(**_LLAMA_KEYS, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=24),
    "gpt2-inner": T.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                               n_inner=40),
}


def _build(config: T.PretrainedConfig) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.AutoModelForCausalLM.from_config(config)


def _first_layer(model: torch.nn.Module) -> torch.nn.Module:
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    return max(lists, key=len)[0]


def test_every_supported_family_is_covered() -> None:
    covered = {c.model_type for c in CONFIGS.values()}
    assert covered == set(FAMILIES)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_counts_match_instantiated_model(key: str) -> None:
    config = CONFIGS[key]
    model = _build(config)
    geometry = geometry_from_config(config.to_dict(), name=key)
    assert geometry.total_param_count == sum(p.numel() for p in model.parameters())
    assert geometry.layer_param_count == sum(p.numel() for p in _first_layer(model).parameters())
    assert geometry.num_layers == config.num_hidden_layers
    assert geometry.tied_embeddings == (geometry.head_param_count == 0)


@pytest.mark.parametrize("key", ["gemma", "opt", "gpt2", "llama", "gpt_neox"])
def test_raw_config_json_without_tie_key_uses_family_default(key: str, tmp_path) -> None:
    """Hub config.json files often omit keys; the family's default must then apply."""
    config = CONFIGS[key]
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    geometry = geometry_from_config(load_model_config(str(tmp_path)))
    assert geometry.total_param_count == sum(p.numel() for p in _build(config).parameters())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from([T.LlamaConfig, T.Qwen2Config, T.Qwen3Config, T.MistralConfig]),
    kv_heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    intermediate=st.integers(8, 64),
    vocab=st.integers(16, 200),
    tied=st.booleans(),
    layers=st.integers(1, 3),
)
def test_random_llama_style_shapes(family, kv_heads, head_dim, intermediate, vocab, tied,
                                   layers) -> None:
    config = family(vocab_size=vocab, hidden_size=4 * head_dim * 2, intermediate_size=intermediate,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                    head_dim=head_dim, tie_word_embeddings=tied, max_position_embeddings=32)
    model = _build(config)
    assert (geometry_from_config(config.to_dict()).total_param_count
            == sum(p.numel() for p in model.parameters()))


def test_multimodal_config_reads_text_config() -> None:
    text = CONFIGS["qwen2"].to_dict()
    wrapped = {"model_type": "qwen2_vl_like", "text_config": text, "tie_word_embeddings": False}
    assert geometry_from_config(wrapped).total_param_count == geometry_from_config(
        text).total_param_count


def test_unknown_llama_style_family_warns_and_counts_as_llama() -> None:
    raw = {**CONFIGS["llama"].to_dict(), "model_type": "my_llama_fork"}
    with pytest.warns(UserWarning, match="my_llama_fork.*approximate"):
        geometry = geometry_from_config(raw)
    assert geometry.total_param_count == geometry_from_config(
        CONFIGS["llama"].to_dict()).total_param_count


def test_unknown_family_without_llama_keys_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model_type='bert'.*supported"):
        geometry_from_config({"model_type": "bert", "hidden_size": 8})


def test_missing_required_key_names_it() -> None:
    raw = CONFIGS["qwen2"].to_dict()
    del raw["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        geometry_from_config(raw)
