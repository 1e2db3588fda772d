"""The model's own compute at `prepare`: its first layer and head timed at the run's shape,
and the workload rates cached under the workload, never applied to another."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from lazytrain_accel.config import LazyTrainConfig
from lazytrain_accel.engine.model.discovery import find_decoder_layers
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.layer_timing import (
    ComputeTiming,
    time_layer_copies,
    time_layer_update,
    time_model_compute,
)
from lazytrain_accel.profiling.workload import (
    WorkloadRates,
    load_workload,
    rates_of,
    save_workload,
    with_workload,
    workload_key,
)
from lazytrain_accel.run import setup, shared
from tests.engine.engine_helpers import build_model


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "bloom"])
def test_the_first_layer_and_head_are_timed_on_their_real_inputs(arch: str) -> None:
    """Families that call their layers with rotary tables (qwen2), positionally (gpt2) or
    with an alibi bias and tuple outputs (bloom): each layer's inputs are the model's own,
    and the model's parameters get no gradient from the probe."""
    model = build_model(arch, 2)
    timing = time_model_compute(model, find_decoder_layers(model)[2], batch_size=2,
                                seq_len=16, device=torch.device("cpu"), compute_dtype=None,
                                repeats=3)
    assert timing.layer_forward_s > 0 and timing.layer_backward_s > 0 and timing.head_s > 0
    assert all(p.grad is None for p in model.parameters())


def test_the_rate_prices_every_layer_run_and_the_head_as_the_planner_does() -> None:
    profile = setup.profile_for_run(build_model("qwen2", 4), batch_size=2, seq_len=16,
                                    compute_dtype=None)
    timing = ComputeTiming(layer_forward_s=1.0, layer_backward_s=3.0, head_s=2.0)
    flops = 4 * (2 * profile.layer_fwd_flops + profile.layer_bwd_flops) + 3 * profile.head_fwd_flops
    assert timing.flops_per_s(profile) == pytest.approx(flops / (4 * 4.0 + 2.0))


def test_a_workload_key_is_its_model_shape_dtype_device_and_threads() -> None:
    model = build_model("qwen2", 2)
    profile = setup.profile_for_run(model, batch_size=2, seq_len=16, compute_dtype=None)
    key = workload_key(profile, device_name="cpu", threads=2)
    others = [
        setup.profile_for_run(model, batch_size=4, seq_len=16, compute_dtype=None),
        setup.profile_for_run(model, batch_size=2, seq_len=32, compute_dtype=None),
        setup.profile_for_run(model, batch_size=2, seq_len=16, compute_dtype=torch.bfloat16),
        setup.profile_for_run(build_model("qwen2", 3), batch_size=2, seq_len=16,
                              compute_dtype=None),
    ]
    keys = {workload_key(p, device_name="cpu", threads=2) for p in others}
    keys |= {workload_key(profile, device_name="gpu", threads=2),
             workload_key(profile, device_name="cpu", threads=1)}
    assert key not in keys and len(keys) == 6
    assert key == workload_key(dataclasses.replace(profile), device_name="cpu", threads=2)


def _auto(tmp_path) -> LazyTrainConfig:
    return LazyTrainConfig(hardware="auto", cache_dir=str(tmp_path / "cache"),
                           nvme_dir=str(tmp_path / "nvme"))


def test_prepare_times_the_workload_once_then_reads_it_back(tmp_path, monkeypatch) -> None:
    config, model = _auto(tmp_path), build_model("qwen2", 2)
    profile = setup.profile_for_run(model, batch_size=2, seq_len=16, compute_dtype=None)
    roofline = HARDWARE_PRESETS["h800"]
    kwargs = dict(device=torch.device("cpu"), compute_dtype=None)
    # after the engine is attached nothing is timed: the profile's rate stands
    assert shared.workload_priced(config, model, profile, roofline, may_time=False,
                                  **kwargs) is roofline
    timed = shared.workload_priced(config, model, profile, roofline, may_time=True, **kwargs)
    assert timed.achieved_flops_per_s != roofline.achieved_flops_per_s
    assert "the model's own layer and head timed at 2 x 16" in timed.source
    monkeypatch.setattr(shared, "_time_workload", lambda *a, **k: pytest.fail("timed again"))
    again = shared.workload_priced(config, model, profile, roofline, may_time=True, **kwargs)
    assert again.achieved_flops_per_s == timed.achieved_flops_per_s
    # another shape is another workload: not timed, it keeps the profile's rate
    longer = setup.profile_for_run(model, batch_size=2, seq_len=32, compute_dtype=None)
    assert shared.workload_priced(config, model, longer, roofline, may_time=False,
                                  **kwargs) is roofline
    # a preset keeps its sourced efficiency
    preset = dataclasses.replace(config, hardware="h800")
    assert shared.workload_priced(preset, model, profile, roofline, may_time=True,
                                  **kwargs) is roofline


def test_the_update_is_timed_on_the_first_layers_own_group(tmp_path, monkeypatch) -> None:
    """Under the hybrid operator the host update is priced at its rate on the model's first
    layer's trainable tensors (what the engine's update runs per group), cached with the
    compute rate; a kept torch optimizer leaves the probe's rate. The model is untouched."""
    model = build_model("qwen2", 2)
    layer = find_decoder_layers(model)[2][0]
    before = [p.detach().clone() for p in model.parameters()]
    assert time_layer_update(layer, compute_dtype=None, on_gpu=False, repeats=3) > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # a layer past the cap is timed on its tensors in order up to it, the last one cut
    from lazytrain_accel.profiling import layer_timing, measure
    timed: list[int] = []
    clipped_step = measure.clipped_step

    def counting_step(params, out):
        timed.append(sum(p.numel() for p in params))
        return clipped_step(params, out)

    monkeypatch.setattr(layer_timing, "MAX_TIMED_UPDATE_PARAMS", 1000)
    monkeypatch.setattr(measure, "clipped_step", counting_step)
    assert time_layer_update(layer, compute_dtype=None, on_gpu=False, repeats=3) > 0
    assert timed == [1000] < [sum(p.numel() for p in layer.parameters())]
    monkeypatch.undo()
    for p in layer.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        time_layer_update(layer, compute_dtype=None, on_gpu=False)
    for p in layer.parameters():
        p.requires_grad_(True)
    profile = setup.profile_for_run(model, batch_size=2, seq_len=16, compute_dtype=None)
    probe = HARDWARE_PRESETS["h800"]
    kwargs = dict(device=torch.device("cpu"), compute_dtype=None, may_time=True)
    hybrid = shared.workload_priced(_auto(tmp_path / "a"), model, profile, probe, **kwargs)
    assert hybrid.cpu_optimizer_params_per_s != probe.cpu_optimizer_params_per_s
    assert "its update" in hybrid.source
    keep = dataclasses.replace(_auto(tmp_path / "b"), optimizer="keep")
    kept = shared.workload_priced(keep, model, profile, probe, **kwargs)
    assert kept.cpu_optimizer_params_per_s == probe.cpu_optimizer_params_per_s
    assert kept.achieved_flops_per_s != probe.achieved_flops_per_s


def test_a_layers_copies_are_timed_on_its_own_tensors_in_the_bytes_the_engine_counts(
        monkeypatch) -> None:
    """Weights: every parameter of the layer copied into a flat buffer of the compute
    dtype; gradients: its trainable ones (fp32), none for a frozen layer."""
    from lazytrain_accel.profiling import layer_timing

    layer = find_decoder_layers(build_model("qwen2", 2))[2][0]
    numel = sum(p.numel() for p in layer.parameters())
    timed: list[int] = []

    def seconds(runs, device, *, repeats, budget_s):
        timed.append(len(runs))
        for run in runs:
            run()
        return [2.0, 4.0][:len(runs)]

    monkeypatch.setattr(layer_timing, "_medians_s", seconds)
    fp32 = time_layer_copies(layer, compute_dtype=None, device_runs_async=False)
    assert (fp32.stage_bytes_per_s, fp32.fold_bytes_per_s) == (numel * 4 / 2, numel * 4 / 4)
    bf16 = time_layer_copies(layer, compute_dtype=torch.bfloat16, device_runs_async=True)
    assert (bf16.stage_bytes_per_s, bf16.fold_bytes_per_s) == (numel * 2 / 2, numel * 2 / 4)
    for p in layer.parameters():
        p.requires_grad_(False)
    frozen = time_layer_copies(layer, compute_dtype=None, device_runs_async=False)
    assert (frozen.stage_bytes_per_s, frozen.fold_bytes_per_s) == (numel * 4 / 2, None)
    assert timed == [2, 2, 1]
    # a layer past the cap: its tensors in order up to it, the last one cut
    monkeypatch.setattr(layer_timing, "MAX_TIMED_UPDATE_PARAMS", 1000)
    capped = time_layer_copies(layer, compute_dtype=None, device_runs_async=False)
    assert capped.stage_bytes_per_s == 1000 * 4 / 2 < numel * 4 / 2


@pytest.mark.parametrize("runs_async", [False, True])
def test_the_layers_copies_price_the_training_threads_copies(tmp_path, runs_async) -> None:
    """A synchronous device (a CPU) copies on the training thread at the links' rates, an
    async one stages and folds there (`planning/problem.py`): the timed rates replace
    those fields and no others."""
    model = build_model("qwen2", 2)
    profile = setup.profile_for_run(model, batch_size=2, seq_len=16, compute_dtype=None)
    probe = dataclasses.replace(HARDWARE_PRESETS["h800"], device_runs_async=runs_async)
    priced = shared.workload_priced(_auto(tmp_path), model, profile, probe,
                                    device=torch.device("cpu"), compute_dtype=None,
                                    may_time=True)
    copies = ("host_stage_bytes_per_s", "host_fold_bytes_per_s")
    links = ("h2d_bytes_per_s", "d2h_bytes_per_s")
    timed, kept = (copies, links) if runs_async else (links, copies)
    assert all(getattr(priced, f) != getattr(probe, f) for f in timed)
    assert all(getattr(priced, f) == getattr(probe, f) for f in kept)
    assert "weights copied in at" in priced.source and "tensor by tensor" in priced.source


def test_a_batch_beyond_the_timed_tokens_is_timed_as_one_shorter_sequence(
        tmp_path, monkeypatch) -> None:
    """A long batch (the engine runs it in tiles) is timed as one sequence of
    `MAX_TIMED_TOKENS`, never at its untiled working set."""
    config, model = _auto(tmp_path), build_model("qwen2", 2)
    profile = setup.profile_for_run(model, batch_size=4, seq_len=32, compute_dtype=None)
    shapes = []

    def timed(model, layers, *, batch_size, seq_len, **kwargs):
        shapes.append((batch_size, seq_len))
        return ComputeTiming(layer_forward_s=1.0, layer_backward_s=2.0, head_s=1.0)

    monkeypatch.setattr(shared, "MAX_TIMED_TOKENS", 16)
    monkeypatch.setattr("lazytrain_accel.profiling.layer_timing.time_model_compute", timed)
    priced = shared.workload_priced(config, model, profile, HARDWARE_PRESETS["h800"],
                                    device=torch.device("cpu"), compute_dtype=None,
                                    may_time=True)
    assert shapes == [(1, 16)] and "timed at 1 x 16" in priced.source


def test_a_layer_the_probe_cannot_call_keeps_the_roofline_and_says_so(tmp_path, monkeypatch,
                                                                      caplog) -> None:
    config, model = _auto(tmp_path), build_model("qwen2", 2)
    profile = setup.profile_for_run(model, batch_size=2, seq_len=16, compute_dtype=None)

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(find_decoder_layers(model)[2][0], "forward", broken)
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        priced = shared.workload_priced(config, model, profile, HARDWARE_PRESETS["h800"],
                                        device=torch.device("cpu"), compute_dtype=None,
                                        may_time=True)
    assert priced is HARDWARE_PRESETS["h800"]
    assert "could not time the model's own layers (RuntimeError: no such kernel)" in caplog.text


def test_a_runs_calibration_is_kept_for_its_workload_and_no_other(tmp_path) -> None:
    """A run's calibration once made the next run of another model plan at its rates
    (6x off): every rate a run calibrates, measured on its own copies, update groups and
    layers, and its fitted step overhead, go under its workload only; the next run of
    another model starts from the machine's probes and its own timed layers."""
    config = _auto(tmp_path)
    demo = setup.profile_for_run(build_model("qwen2", 2), batch_size=2, seq_len=16,
                                 compute_dtype=None)
    other = setup.profile_for_run(build_model("llama", 2), batch_size=2, seq_len=16,
                                  compute_dtype=None)
    machine = HARDWARE_PRESETS["h800"]
    calibrated = dataclasses.replace(machine, h2d_bytes_per_s=1e9,
                                     cpu_optimizer_params_per_s=8.9e7,
                                     achieved_flops_per_s=1.4e10, step_overhead_s=0.5)
    kept = rates_of(calibrated, source="a test")
    assert set(kept.rates) >= {"h2d_bytes_per_s", "cpu_optimizer_params_per_s",
                               "achieved_flops_per_s", "step_overhead_s"}
    save_workload(config.cache_dir, workload_key(demo, device_name="cpu", threads=2), kept)
    again = with_workload(machine, load_workload(
        config.cache_dir, workload_key(demo, device_name="cpu", threads=2)))
    assert dataclasses.replace(again, source="") == dataclasses.replace(calibrated, source="")
    assert load_workload(config.cache_dir, workload_key(other, device_name="cpu",
                                                        threads=2)) is None
    with pytest.raises(ValueError, match="a workload owns only"):
        WorkloadRates(rates={"gpu_memory_bytes": 1.0})
