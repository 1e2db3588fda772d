"""The head + loss working set (unchunked HF loss) is part of the GPU's static bytes."""

from __future__ import annotations

from lazytrain_accel.planning import build_problem
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)


def test_logits_bound_the_gpu_static_bytes_at_large_vocab() -> None:
    geometry = geometry_from_config(load_model_config("qwen2.5-3b"))
    model = profile_model(geometry, batch_size=8, seq_len=1024)
    tokens = 8 * 1024
    # bf16 logits + fp32 upcast + fp32 gradient of the logits
    assert model.head_working_bytes == tokens * geometry.vocab_size * (2 + 4 + 4)
    assert model.head_working_bytes > model.layer_working_bytes  # Qwen's 151k vocabulary
    problem = build_problem(model, HARDWARE_PRESETS["rtx3090"])
    weights_and_grads = 3 * model.layer_param_bytes + 2 * model.layer_grad_bytes
    assert problem.static_gpu_bytes == (weights_and_grads + model.head_working_bytes
                                        + 2 * model.resident_param_bytes)


def test_shortfalls_of_small_models_are_shown_in_readable_units() -> None:
    import pytest

    from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan

    geometry = geometry_from_config(load_model_config("tiny-demo"))
    model = profile_model(geometry, batch_size=2, seq_len=64)
    budgets = Budgets(gpu_bytes=2**20, cpu_bytes=2**40, nvme_bytes=2**40)
    with pytest.raises(PlanInfeasibleError) as info:
        make_plan(model, HARDWARE_PRESETS["h800"],
                  PlanRequest(strategy="checkpoint_all", budgets=budgets))
    text = str(info.value)
    assert "0.00 GiB" not in text and "MiB" in text and "KiB per boundary" in text
