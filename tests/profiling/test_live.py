"""Profiles from the model in hand: counts from its own parameters, any decoder family."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import ARCH_CONFIGS, build_model

from lazytrain_accel.engine.model.discovery import find_decoder_layers
from lazytrain_accel.profiling.families import FAMILIES
from lazytrain_accel.profiling.live import geometry_from_model
from lazytrain_accel.profiling.model_configs import geometry_from_config
from lazytrain_accel.run.setup import geometry_for_run, profile_for_run


def _live(model: torch.nn.Module):
    return geometry_from_model(model, list(find_decoder_layers(model)[2]))


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_live_counts_are_the_model_parameters(arch):
    model = build_model(arch, 2)
    g = _live(model)
    layers = find_decoder_layers(model)[2]
    assert g.num_layers == 2
    assert g.layer_param_count == sum(p.numel() for p in layers[0].parameters())
    assert g.total_param_count == sum(p.numel() for p in model.parameters())
    assert g.hidden_size == 32 and g.vocab_size == 96


@pytest.mark.parametrize("arch", sorted(a for a in ARCH_CONFIGS if a in FAMILIES))
def test_the_family_table_agrees_with_the_live_count(arch):
    model = build_model(arch, 2)
    table = geometry_from_config(model.config.to_dict())
    live = _live(model)
    assert (table.layer_param_count, table.total_param_count) == (
        live.layer_param_count, live.total_param_count)
    assert geometry_for_run(model) == table  # same geometry: a CLI plan keeps its fingerprint


def test_a_family_outside_the_table_gets_a_live_profile():
    model = build_model("gpt_bigcode", 2)
    assert model.config.model_type not in FAMILIES
    profile = profile_for_run(model, batch_size=2, seq_len=8, compute_dtype=torch.bfloat16)
    g = profile.geometry
    assert g.family == "gpt_bigcode" and g.num_kv_heads == 1  # multi-query attention
    assert profile.layer_param_bytes == 2 * g.layer_param_count
    assert profile.boundary_bytes == 2 * 8 * 32 * 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_streams_every_expert_and_computes_with_top_k(arch):
    model = build_model(arch, 2)
    layer = find_decoder_layers(model)[2][0]
    experts = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")
    total = sum(p.numel() for p in layer.parameters())
    g = _live(model)
    assert experts > total / 2  # the test model is expert-heavy
    assert g.layer_param_count == total
    assert g.active_layer_param_count == round(total - experts + experts * 2 / 8)  # top-2 of 8
    profile = profile_for_run(model, batch_size=1, seq_len=4, compute_dtype=None)
    assert profile.layer_param_bytes == 4 * total  # every expert's weights stream
    attention_flops = 4.0 * 1 * 4 * 4 * g.num_attention_heads * g.head_dim
    assert profile.layer_fwd_flops == 2.0 * 4 * g.active_layer_param_count + attention_flops


def test_an_unsupported_model_is_told_what_is_missing():
    from lazytrain_accel.engine.model.discovery import UnsupportedModelError

    class NoStack(torch.nn.Module):
        config = build_model("llama", 2).config

        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(UnsupportedModelError, match="no ModuleList of identical decoder blocks"):
        profile_for_run(NoStack(), batch_size=1, seq_len=4, compute_dtype=None)
    model = build_model("llama", 2)
    model.config = SimpleNamespace(num_attention_heads=4, model_type="custom")
    with pytest.raises(ValueError, match="no hidden size"):
        _live(model)
