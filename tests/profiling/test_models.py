"""Model presets, config loading and the analytic per-layer profile."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as T
from torch.utils.flop_counter import FlopCounterMode

from lazytrain_accel.profiling.model_configs import (
    MODEL_PRESETS,
    geometry_from_config,
    load_model_config,
    model_preset_source,
    profile_model,
)

_GIB = 1024**3

# Published parameter counts of the real checkpoints (billions), to 0.01B.
_KNOWN_BILLIONS = {"qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.77,
                   "llama3-8b": 8.03, "llama3-70b": 70.55,
                   "llama3.1-405b": 405.85}


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_every_preset_loads_with_a_source(name: str) -> None:
    geometry = geometry_from_config(load_model_config(name), name)
    assert geometry.name == name
    assert len(model_preset_source(name)) > 20
    assert "_lazytrain_source" not in load_model_config(name)  # a plain HF config


@pytest.mark.parametrize("name", sorted(_KNOWN_BILLIONS))
def test_preset_parameter_counts_match_published(name: str) -> None:
    total = geometry_from_config(load_model_config(name)).total_param_count
    assert total / 1e9 == pytest.approx(_KNOWN_BILLIONS[name], abs=0.01)


def test_paper_27b_geometry_and_boundary() -> None:
    geometry = geometry_from_config(load_model_config("qwen3.6-27b"))
    profile = profile_model(geometry, batch_size=72, seq_len=1024)
    assert geometry.num_layers == 64 and geometry.hidden_size == 5120
    assert 26.5e9 < geometry.total_param_count < 27.5e9
    assert profile.boundary_bytes / _GIB == pytest.approx(0.703, abs=0.001)


def test_405b_preset_profiles_one_layer_of_its_published_shape() -> None:
    geometry = geometry_from_config(load_model_config("llama3.1-405b"))
    profile = profile_model(geometry, batch_size=1, seq_len=4096)
    assert geometry.num_layers == 126 and geometry.hidden_size == 16384
    assert geometry.total_param_count == pytest.approx(405e9, rel=0.01)
    # q, o 16384^2; k, v 16384 x 1024 (8 KV heads of 128); MLP 3 x 16384 x 53248; 2 norms
    layer_params = 2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384
    assert profile.layer_param_bytes == 2 * layer_params
    assert profile.boundary_bytes == 4096 * 16384 * 2


def test_tiny_demo_preset_builds_a_real_model() -> None:
    config = load_model_config("tiny-demo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(**config))
    assert sum(p.numel() for p in model.parameters()) == geometry_from_config(
        config).total_param_count


def test_profile_bytes_follow_the_batch_shape() -> None:
    geometry = geometry_from_config(load_model_config("qwen2.5-7b"))
    small = profile_model(geometry, batch_size=2, seq_len=512)
    big = profile_model(geometry, batch_size=4, seq_len=512, compute_bytes_per_elem=4)
    assert small.boundary_bytes == 2 * 512 * 3584 * 2
    assert big.boundary_bytes == 4 * small.boundary_bytes
    assert small.layer_param_bytes == geometry.layer_param_count * 2
    assert big.layer_grad_bytes == geometry.layer_param_count * 4
    assert small.layer_bwd_flops == 2 * small.layer_fwd_flops
    assert small.resident_param_bytes == 2 * (geometry.embedding_param_count
                                              + geometry.head_param_count
                                              + geometry.final_norm_param_count)
    # The working set grows with tokens but always holds at least the layer's gradients.
    assert small.layer_grad_bytes < small.layer_working_bytes < big.layer_working_bytes
    assert small.tokens_per_step == 1024


def test_attention_flops_grow_quadratically_with_seq() -> None:
    geometry = geometry_from_config(load_model_config("llama3-8b"))
    a, b = (profile_model(geometry, batch_size=1, seq_len=s) for s in (1024, 2048))
    linear = 2.0 * 1024 * geometry.layer_param_count
    attention = 4.0 * 1024**2 * geometry.num_attention_heads * geometry.head_dim
    assert a.layer_fwd_flops == pytest.approx(linear + attention)
    assert b.layer_fwd_flops == pytest.approx(2 * linear + 4 * attention)


def test_layer_flops_match_torch_flop_counter() -> None:
    """Forward: matmuls (weights + eager attention) as counted by torch, plus 2 FLOPs per
    token for each bias/norm parameter, which the analytic formula folds in; backward: 2x."""
    config = T.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    batch, seq = 2, 16
    ids = torch.randint(0, 97, (batch, seq))
    # Backward FLOPs are attributed to a module only when its forward ran under the same
    # counter, so count forward alone, then forward + backward.
    fwd_counter, step_counter = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd_counter:
        model(ids)
    with step_counter:
        model(ids).logits.sum().backward()
    key = "Qwen2ForCausalLM.model.layers.0"
    counted_fwd = sum(fwd_counter.get_flop_counts()[key].values())
    counted_bwd = sum(step_counter.get_flop_counts()[key].values()) - counted_fwd
    vector_params = sum(p.numel() for p in layer.parameters() if p.ndim == 1)
    profile = profile_model(geometry_from_config(config.to_dict()), batch_size=batch,
                            seq_len=seq, compute_bytes_per_elem=4)
    assert profile.layer_fwd_flops == counted_fwd + 2 * batch * seq * vector_params
    assert counted_bwd == 2 * counted_fwd
    # The head adds ~5 elementwise FLOPs per logit for softmax + cross-entropy.
    head_matmul = sum(fwd_counter.get_flop_counts()["Qwen2ForCausalLM.lm_head"].values())
    assert profile.head_fwd_flops == head_matmul + 5 * batch * seq * 97


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_size": 0, "seq_len": 8}, "batch_size=0"),
    ({"batch_size": 1, "seq_len": -1}, "seq_len=-1"),
    ({"batch_size": 1.5, "seq_len": 8}, "batch_size=1.5"),
    ({"batch_size": 1, "seq_len": 8, "compute_bytes_per_elem": 3}, "compute_bytes_per_elem=3"),
])
def test_profile_model_rejects_bad_shapes(kwargs: dict, match: str) -> None:
    geometry = geometry_from_config(load_model_config("tiny-demo"))
    with pytest.raises(ValueError, match=match):
        profile_model(geometry, **kwargs)


def test_load_model_config_from_directory_and_file(tmp_path) -> None:
    raw = load_model_config("tiny-demo")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model_config(str(tmp_path)) == raw
    assert load_model_config(str(tmp_path / "config.json")) == raw


def test_load_model_config_errors_say_what_to_do(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_config("qwen9-1t")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_model_config(str(tmp_path))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_config(str(tmp_path / "list.json"))
    with pytest.raises(ValueError, match="not a model preset"):
        model_preset_source("qwen9-1t")
