"""Trainable vs frozen in profiles (issue 17 item 1): from a config (`--lora-rank`,
`--frozen-format`) and from a live model (requires_grad, bitsandbytes Params4bit and
Int8Params), and what the planner's cost model charges for each."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lazytrain_accel.planning import make_plan, simulate
from lazytrain_accel.planning.host import OPTIMIZER_STATE_BYTES_PER_PARAM
from lazytrain_accel.planning.problem import build_problem
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.adapters import lora_profile_inputs
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.live import geometry_from_model, weight_split_from_model
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)

H800 = HARDWARE_PRESETS["h800"]


def _llama8b(fmt: str | None, rank: int = 16):
    g = geometry_from_config(load_model_config("llama3-8b"))
    if fmt is None:
        return g, profile_model(g, batch_size=1, seq_len=1024)
    adapted, split = lora_profile_inputs(g, rank=rank, frozen_format=fmt)
    return g, profile_model(adapted, batch_size=1, seq_len=1024, weights=split)


def test_lora_counts_adapters_as_the_only_trainable_parameters() -> None:
    g, lora = _llama8b("bf16")
    h, kv, inter = 4096, 1024, 14336
    adapters = 16 * ((h + h) * 2 + (h + kv) * 2 + 3 * (h + inter))
    assert lora.layer_trainable_param_count == adapters
    assert lora.weights.layer_frozen_param_count == g.layer_param_count
    assert lora.geometry.layer_param_count == g.layer_param_count + adapters
    assert lora.resident_trainable_param_count == 0
    assert lora.layer_grad_bytes == 2 * adapters  # gradients: adapters only, bf16
    assert lora.layer_param_bytes == 2 * (adapters + g.layer_param_count)


def test_nf4_streams_half_a_byte_per_weight_plus_scales() -> None:
    g, qlora = _llama8b("nf4")
    w = qlora.weights
    matrices = w.layer_packed_param_count
    assert w.layer_frozen_scale_bytes == 4 * math.ceil(matrices / 64)  # fp32 absmax / 64
    norms = g.layer_param_count - matrices
    assert w.layer_packed_bytes == matrices // 2 + w.layer_frozen_scale_bytes
    assert qlora.layer_param_bytes == (w.layer_packed_bytes + 2 * norms
                                       + 2 * w.layer_trainable_param_count)
    _, lora = _llama8b("bf16")
    assert 0.27 < qlora.layer_param_bytes / lora.layer_param_bytes < 0.30


def test_problem_charges_host_memory_and_updates_for_trainable_only() -> None:
    _, full = _llama8b(None)
    _, qlora = _llama8b("nf4")
    p_full, p_q = build_problem(full, H800), build_problem(qlora, H800)
    state = OPTIMIZER_STATE_BYTES_PER_PARAM["hybrid8bit"]
    n, L = full.trainable_param_count, full.num_layers
    # masters + gradients (fp32), 8-bit state, bf16 compute copies of every layer weight,
    # pinned staging for 2 layers of weights and 2 of gradients
    assert p_full.static_cpu_bytes == (8 * n + int(state * n)
                                       + L * 2 * full.geometry.layer_param_count
                                       + 2 * full.layer_param_bytes + 2 * full.layer_grad_bytes)
    n, w = qlora.trainable_param_count, qlora.weights
    floats = qlora.geometry.layer_param_count - w.layer_packed_param_count
    # packed weights: no compute copy; their staging sits beside each of 3 weight slots
    assert p_q.static_cpu_bytes == (8 * n + int(state * n) + qlora.frozen_host_bytes
                                    + L * 2 * floats
                                    + 2 * (qlora.layer_param_bytes - w.layer_packed_bytes)
                                    + 3 * w.layer_packed_bytes + 2 * qlora.layer_grad_bytes)
    assert p_q.layer_update_param_count == qlora.layer_trainable_param_count
    assert p_q.resident_update_param_count == 0 and p_q.tail_d2h_bytes == p_q.layer_grad_bytes
    assert p_q.grad_d2h_bytes(p_q.num_layers + 1) == qlora.layer_grad_bytes
    # a frozen matrix's backward is input gradients only: less than 2x its forward
    assert qlora.layer_bwd_flops < 1.8 * qlora.layer_fwd_flops


def test_simulated_host_optimizer_updates_adapters_only() -> None:
    _, qlora = _llama8b("nf4")
    plan = make_plan(qlora, H800, PlanRequest(strategy="checkpoint_all"))
    ops = {op.name: op for op in simulate(plan, qlora, H800).ops}
    assert ops["U1"].duration_s == pytest.approx(
        qlora.layer_trainable_param_count / H800.cpu_optimizer_params_per_s)
    assert ops["U_embed"].duration_s == ops["U_head"].duration_s == 0.0  # frozen: no update


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))


def test_full_fine_tune_has_no_split() -> None:
    model = _tiny_llama()
    assert weight_split_from_model(model, list(model.model.layers)) is None


def test_live_peft_lora_split() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"]))
    layers = list(model.base_model.model.model.layers)
    split = weight_split_from_model(model, layers)
    adapters = sum(p.numel() for p in layers[0].parameters() if p.requires_grad)
    assert split.layer_trainable_param_count == adapters == 4 * ((64 + 64) + (64 + 32))
    assert split.frozen_format == "fp32" and split.layer_packed_param_count == 0
    frozen = sum(p.numel() for p in layers[0].parameters() if not p.requires_grad)
    assert split.layer_frozen_host_bytes == 4 * frozen
    assert split.resident_trainable_param_count == 0


def test_live_bitsandbytes_4bit_and_int8_are_read_as_stored() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    model = _tiny_llama()
    full = geometry_from_model(model, list(model.model.layers))
    layer = model.model.layers[0]
    q4 = bnb.nn.Linear4bit(64, 128, bias=False, quant_type="nf4", compress_statistics=False)
    q4.weight = bnb.nn.Params4bit(layer.mlp.up_proj.weight.data.clone(), requires_grad=False,
                                  quant_type="nf4", compress_statistics=False)
    layer.mlp.up_proj = q4.to("cpu")
    q8 = bnb.nn.Linear8bitLt(128, 64, bias=False, has_fp16_weights=False)
    q8.weight = bnb.nn.Int8Params(layer.mlp.down_proj.weight.data.clone(),
                                  requires_grad=False, has_fp16_weights=False)
    layer.mlp.down_proj = q8.to("cpu")
    assert layer.mlp.up_proj.weight.dtype == torch.uint8  # packed on CPU
    split = weight_split_from_model(model, list(model.model.layers))
    geometry = geometry_from_model(model, list(model.model.layers))
    assert geometry.layer_param_count == full.layer_param_count  # logical counts
    assert split.layer_packed_param_count == 2 * 64 * 128
    scales = 4 * (64 * 128 // 64) + 16 * 4 + 4 * 64  # nf4 absmax + code, int8 SCB
    assert split.layer_frozen_scale_bytes == scales
    assert split.layer_packed_bytes == 64 * 128 // 2 + 64 * 128 + scales
    assert split.layer_dequant_elems == 64 * 128
