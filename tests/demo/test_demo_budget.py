"""The demo's device budget: MegaTrain just fits, and LazyTrain must place boundaries."""

from __future__ import annotations

import pytest
from conftest import cpu_profile

from lazytrain_accel.demo.budget import GIB, demo_gpu_budget_gb
from lazytrain_accel.demo.model import DEMO_MODEL_CONFIG
from lazytrain_accel.planning import Budgets, Home, PlanInfeasibleError, make_plan, simulate
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.model_configs import geometry_from_config, profile_model


@pytest.mark.parametrize("batch_size", [8, 32])
def test_budget_fits_megatrain_exactly_and_makes_lazytrain_offload(batch_size: int) -> None:
    hardware = cpu_profile()
    config = {**DEMO_MODEL_CONFIG, "model_type": "qwen2", "vocab_size": 80}
    model = profile_model(geometry_from_config(config), batch_size=batch_size, seq_len=48,
                          compute_bytes_per_elem=4)
    budget_gb = demo_gpu_budget_gb(model, hardware)
    budgets = Budgets.from_hardware(hardware, gpu_memory_limit_gb=budget_gb)
    megatrain = make_plan(model, hardware, PlanRequest(strategy="megatrain", budgets=budgets))
    lazytrain = make_plan(model, hardware, PlanRequest(budgets=budgets))
    # Smallest: one boundary less and MegaTrain no longer fits.
    smaller = budget_gb - model.boundary_bytes / GIB
    with pytest.raises(PlanInfeasibleError):
        budgets = Budgets.from_hardware(hardware, gpu_memory_limit_gb=smaller)
        make_plan(model, hardware, PlanRequest(strategy="megatrain", budgets=budgets))
    assert sum(h != Home.GPU for h in lazytrain.homes) >= 3
    lazy_sim, mega_sim = (simulate(p, model, hardware) for p in (lazytrain, megatrain))
    assert lazy_sim.peak_gpu_bytes <= budgets.gpu_bytes
    assert lazy_sim.step_s <= mega_sim.step_s


def test_a_budget_from_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch,
                                               hardware_json) -> None:
    """LAZYTRAIN_GPU_MEMORY_LIMIT_GB (even 0, "the whole device") beats the demo budget;
    without it the demo plans in MegaTrain's budget."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lazytrain_accel.demo.run import DemoSettings, _accelerator

    model = Qwen2ForCausalLM(Qwen2Config(**DEMO_MODEL_CONFIG, vocab_size=80))
    settings = DemoSettings(hardware=str(hardware_json), batch_size=8)
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_LIMIT_GB", "0")
    assert _accelerator(settings, model).lazytrain_plugin.gpu_memory_limit_gb == 0
    monkeypatch.delenv("LAZYTRAIN_GPU_MEMORY_LIMIT_GB")
    budget_gb = _accelerator(settings, model).lazytrain_plugin.gpu_memory_limit_gb
    assert 0 < budget_gb * GIB < 64 * 2**20  # tens of MiB: MegaTrain's need
