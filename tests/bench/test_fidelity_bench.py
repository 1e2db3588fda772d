"""bench/fidelity.py's code path on a tiny model: measured compute, profile, link rates, the
plans it promises (one with NVMe homes), one emulated round and its prediction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
fidelity = pytest.importorskip("fidelity")

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 64}
#: Fixed seconds, so the links (chosen against compute) do not depend on machine load.
COMPUTE = {"fwd_s": 0.002, "bwd_s": 0.004, "rest_s": 0.005}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_compute_is_measured_per_term():
    compute, overhead = fidelity.measure_compute(TINY, 2, 16, steps=1)
    assert set(compute) == {"fwd_s", "bwd_s", "rest_s"}
    assert compute["fwd_s"] > 0 and compute["bwd_s"] > 0
    # the engine's cost per layer beyond its compute: a difference of two timings, which a
    # loaded machine can make negative, kept at zero then (never a timed assertion here)
    assert overhead.forward_s >= 0 and overhead.backward_s >= 0 and overhead.step_s >= 0


def test_rates_plans_and_one_round(tmp_path):
    profile = fidelity.measured_profile(TINY, 2, 16, COMPUTE)
    assert profile.layer_fwd_flops == pytest.approx(COMPUTE["fwd_s"] * 1e12)
    hw = fidelity.link_hardware(profile, COMPUTE, 1e8, host_rates=(1e10, 5e9))
    # a layer's weights take H2D_FORWARDS layer forwards on the throttled link
    assert profile.layer_param_bytes / hw.h2d_bytes_per_s == pytest.approx(
        fidelity.H2D_FORWARDS * COMPUTE["fwd_s"])
    plans = fidelity.plans(profile, hw)
    assert plans["megatrain"].count_homes()["recompute"] > 0
    assert plans["offload_all"].count_homes()["cpu"] > 0
    assert plans["auto+nvme"].count_homes()["nvme"] > 0
    (measured,) = fidelity.run_plan(TINY, plans["auto+nvme"], hw, 2, 16, 1, 2,
                                     str(tmp_path))
    assert {"step", "step_compute", "step_opt", "step_opt_compute", "step_layers",
            "step_opt_update", "step_waited", "optimizer_rate", "compute_opt"} <= set(measured)
    # what the training thread waited is part of the step (the engine's stall_s)
    assert 0 < measured["step_waited"] < measured["step"]
    # the step with the optimizer is predicted on the compute measured beside the update:
    # the same layers, the rest with what the update took from the step
    assert {k: measured["compute_opt"][k] for k in ("fwd_s", "bwd_s")} == {
        k: measured["compute"][k] for k in ("fwd_s", "bwd_s")}
    assert measured["compute_opt"]["rest_s"] >= measured["compute"]["rest_s"]
    assert measured["step"] > 0 and measured["step_opt_update"] > 0
    preds = fidelity.predictions(plans["auto+nvme"], TINY, 2, 16, measured, hw,
                                 profile.trainable_param_count)
    pred, pred_opt = preds["step"], preds["opt"]
    assert pred_opt.step_s >= pred.step_s > pred.exposed_s > 0
    assert not any(op.resource == "host_optimizer" for op in pred.ops)
    # in-step predictions take each engine's own timed layers: no order between them
    assert preds["opt_in"].step_s > 0 and preds["step_in"].step_s > 0
    # the prediction charges the layer runs' overhead the round measured on the emulated
    # backend, as the measured compute does
    ran, plan = measured["overhead"], plans["auto+nvme"]
    runs_s = ((plan.num_layers + plan.recomputed_layer_runs) * ran.forward_s
              + plan.num_layers * ran.backward_s + ran.step_s)
    assert ran.forward_s > 0 and pred.overhead_s == pytest.approx(runs_s)
    # the host's work per transfer: the compute's thread does it on the emulated device,
    # so the step's compute holds what it measured, and the prediction the same work at
    # the rates the step ran it
    host = measured["step_host"]
    assert host["host_s"] > 0 and host["host_stage"] > 0 and host["host_fold"] > 0
    assert measured["step_compute"] == pytest.approx(
        measured["step_layers"] + measured["compute"]["rest_s"] + runs_s + host["host_s"])
    terms = preds["step_in"]  # the exposed and host terms: on the step's own compute
    assert hw.compute_on_host and terms.host_s > 0
    row = fidelity._row("tiny", "auto+nvme", plans["auto+nvme"], preds, measured)
    assert row.count("|") == 8
    assert row.split("|")[3].split() == [f"{terms.host_s:.3f}", f"{host['host_s']:.3f}"]
    # the exposed term twice: waited (stall_s), then the step less its compute
    exposed_s = measured["step"] - measured["step_compute"]
    _, waited, waited_ratio, difference, difference_ratio = row.split("|")[4].split()
    assert (waited, waited_ratio) == (f"{measured['step_waited']:.3f}",
                                      f"{measured['step_waited'] / terms.exposed_s:.2f}")
    assert (difference, difference_ratio) == (f"{exposed_s:.3f}",
                                              f"{exposed_s / terms.exposed_s:.2f}")


def test_the_update_is_timed_as_a_step_runs_it():
    """On the engine's update thread, beside a calibration step, freeing each group's
    gradients after its update (the step's deferred zero_grad)."""
    update = fidelity._UpdateBeside(TINY)
    calibration = fidelity._Calibration(TINY, 2, 16)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    ran = []

    def beside() -> dict[str, float]:
        ran.append(True)
        return calibration.measure(ids)

    rate, compute = update.measure(beside)
    calibration.engine.detach()
    assert ran and rate > 0 and compute["fwd_s"] > 0
    assert all(p.grad is None for p in update.model.parameters())
    # every parameter once (the demo's head is tied to its embeddings)
    assert update.params == sum(p.numel() for p in update.model.parameters())


def test_the_emulated_device_updates_residents_beside_the_host():
    """The plans run on the emulated device, which is async: the engine updates the
    device residents on the training thread beside the update thread, and the hardware
    profile tells the simulator so; the update's simulated seconds are its span."""
    from lazytrain_accel.engine.device.emulation import EmulatedStreams

    profile = fidelity.measured_profile(TINY, 2, 16, COMPUTE)
    hw = fidelity.link_hardware(profile, COMPUTE, 1e8)
    assert hw.device_runs_async is EmulatedStreams.is_async
    # (the planner itself no longer gains by it where the compute is the host's cores:
    # both updates take them, so it keeps the residents on the host unless told)
    plan = fidelity.make_plan(profile, hw, fidelity.PlanRequest(
        strategy="offload_all", resident_update="device", time_limit_s=20.0))
    assert plan.resident_update == "device"
    result = fidelity.simulate(plan, profile, hw)
    ops = [op for op in result.ops if fidelity.is_optimizer_lane(op.resource)]
    assert fidelity._update_s(result) < sum(op.duration_s for op in ops)  # side by side
