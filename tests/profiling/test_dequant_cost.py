"""The device-side dequantization of packed (QLoRA) weights is priced (issue 17): a packed
layer's forward and backward proper each pay its bytes moved (packed read + compute-dtype
write) at the hardware's `dequant_bytes_per_s`; frozen bf16 weights pay nothing. The MIP's
prediction and the simulator still agree."""

from __future__ import annotations

import pytest

from lazytrain_accel.planning import make_plan, simulate
from lazytrain_accel.planning.problem import build_problem
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.adapters import lora_profile_inputs
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)
from lazytrain_accel.profiling.profile import ModelProfile

RTX4090 = HARDWARE_PRESETS["rtx4090"]


def _lora(fmt: str, batch_size: int = 1) -> ModelProfile:
    g = geometry_from_config(load_model_config("llama3-8b"))
    adapted, split = lora_profile_inputs(g, rank=16, frozen_format=fmt)
    return profile_model(adapted, batch_size=batch_size, seq_len=1024, weights=split)


def _compute_s(model: ModelProfile, hw: HardwareProfile) -> tuple[float, float]:
    rate = hw.achieved_flops_per_s
    return model.layer_fwd_flops / rate, model.layer_bwd_flops / rate


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_frozen_float_weights_pay_no_dequantization(fmt: str) -> None:
    model = _lora(fmt)
    assert model.weights.layer_dequant_bytes(model.compute_bytes_per_elem) == 0
    p = build_problem(model, RTX4090)
    assert (p.fwd_s, p.bwd_s) == _compute_s(model, RTX4090)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_packed_weights_pay_a_dequantization_per_pass(fmt: str) -> None:
    model = _lora(fmt)
    w = model.weights
    moved = w.layer_packed_bytes + 2 * w.layer_packed_param_count  # bf16 copy written
    assert w.layer_dequant_bytes(2) == moved > 0
    dequant_s = moved / RTX4090.dequant_bytes_per_s
    fwd_s, bwd_s = _compute_s(model, RTX4090)
    p = build_problem(model, RTX4090)
    assert p.fwd_s == pytest.approx(fwd_s + dequant_s)
    assert p.bwd_s == pytest.approx(bwd_s + dequant_s)
    # the backward window re-runs the forward: two dequantizations per layer there
    assert p.base_duration_s(p.num_layers + 1) == pytest.approx(
        fwd_s + bwd_s + 2 * dequant_s + RTX4090.layer_backward_overhead_s)
    # llama3-8b at 1 x 1024 on an RTX 4090: 3 passes = 19% (nf4) / 22% (int8) of fwd + bwd
    assert 0.1 < 3 * dequant_s / (fwd_s + bwd_s) < 0.3


def test_a_slower_dequantization_slows_the_plan_and_the_simulation_agrees() -> None:
    model = _lora("nf4", batch_size=2)
    slow = HardwareProfile(**{**RTX4090.to_dict(), "dequant_bytes_per_s": 1e11})
    plans = [make_plan(model, hw, PlanRequest(strategy="checkpoint_all")) for hw in (RTX4090, slow)]
    assert plans[1].prediction.step_s > plans[0].prediction.step_s
    for plan, hw in zip(plans, (RTX4090, slow), strict=True):
        result = simulate(plan, model, hw)
        assert result.step_s == pytest.approx(plan.prediction.step_s, rel=1e-6)
    lazy = make_plan(model, slow, PlanRequest(time_limit_s=30))
    assert simulate(lazy, model, slow).step_s == pytest.approx(lazy.prediction.step_s,
                                                               rel=0.05)


def test_presets_derive_the_rate_from_memory_bandwidth_and_say_so() -> None:
    for name, bandwidth_bytes_per_s in (("rtx4090", 1008e9), ("h800", 3350e9)):
        hw = HARDWARE_PRESETS[name]
        assert hw.dequant_bytes_per_s == pytest.approx(0.7 * bandwidth_bytes_per_s)
        assert "dequantization" in hw.source and "memory bandwidth" in hw.source
    old = {k: v for k, v in RTX4090.to_dict().items() if k != "dequant_bytes_per_s"}
    assert HardwareProfile.from_dict(old).dequant_bytes_per_s > 0  # a file written before
