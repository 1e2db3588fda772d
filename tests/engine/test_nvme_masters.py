"""The layers' fp32 masters and optimizer moments homed on NVMe (`Plan.state.optimizer`,
issue 44): written to a file at attach and after each update, read back for the next
one, placeholders in between; the run is the all-DRAM run bit for bit (8-bit and fp32
moments, clipping, accumulation, with the other parts homed too, a skipped step, a
re-plan either way), and the files go at detach."""

from __future__ import annotations

import copy
import dataclasses
import errno
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import batches, build_model, fail_writes, make_plan, train_clipped, twin

from lazytrain_accel.engine import attach
from lazytrain_accel.optim import HybridAdamW8bit
from lazytrain_accel.planning.plan import StateHomes
from lazytrain_accel.storage.direct_io import StateIOError

CPU = torch.device("cpu")
LAYERS = 4
MICRO_BATCHES = 2


def _train(model, plan, tmp_path, *, between=None, min_8bit_numel: int = 0, **kwargs):
    """`train_clipped` in bf16 (8-bit moments for every tensor by default);
    `between(engine, opt, step)` after each step's update."""
    return train_clipped(model, plan, tmp_path, micro_batches=MICRO_BATCHES,
                         dtype=torch.bfloat16, after_step=between,
                         min_8bit_numel=min_8bit_numel, **kwargs)


def _assert_same(model, ref, opt, ref_opt) -> None:
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.parametrize("min_8bit_numel", [0, 4096], ids=["8bit", "fp32-moments"])
@pytest.mark.parametrize("homes", [
    StateHomes(optimizer=(1, 3)),
    StateHomes(optimizer=(1, 2, 3, 4), grads=(1, 2), copies=(2, 3, 4)),
], ids=["optimizer", "all-parts"])
def test_masters_on_nvme_train_bit_for_bit_as_in_dram(tmp_path, homes, min_8bit_numel):
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    ref_engine, ref_opt, ref_losses = _train(ref, plan, tmp_path / "dram",
                                             min_8bit_numel=min_8bit_numel)
    evicted: list[list[int]] = []

    def between(engine, opt, step: int) -> None:
        # between steps the homed layers' masters and moments hold no bytes
        evicted.append(engine.masters.evicted_layers)
        for j in homes.optimizer:
            for p in engine.layer_params(j):
                assert p.data.stride() == (0,) * p.dim() and p.data.isnan().all()
                assert all(t.stride() == (0,) * t.dim() for name, t in opt.state[p].items()
                           if name != "step")

    engine, opt, losses = _train(model, dataclasses.replace(plan, state=homes),
                                 tmp_path / "nvme", min_8bit_numel=min_8bit_numel,
                                 between=between)
    assert losses == ref_losses
    assert evicted == [list(homes.optimizer)] * 3
    state = engine.spill.directories[0] / "state"
    assert {p.name for p in state.iterdir()} >= {f"optim-{j}.bin" for j in homes.optimizer}
    numel = sum(p.numel() for p in engine.layer_params(1))
    moved = engine.total_stats().transfer_bytes
    directory = engine.spill.directories[0]
    engine.detach()  # masters and moments back in DRAM, the files gone
    ref_engine.detach()
    assert not directory.exists()
    # per homed layer: its masters written at attach; per update, masters and moments
    # read (none before the first) and written; 8-bit moments are ~2 bytes a parameter
    moments = 2.0 if min_8bit_numel == 0 else 8.0
    homed = len(homes.optimizer)
    grads = len(homes.grads) * 3 * MICRO_BATCHES * 4 * numel
    assert moved["state_nvme_read"] >= homed * numel * (3 * 4 + 2 * moments)
    assert moved["state_nvme_write"] >= homed * numel * (4 + 3 * (4 + moments)) + grads
    _assert_same(model, ref, opt, ref_opt)


def test_a_skipped_step_leaves_the_files_as_they_were(tmp_path):
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    _, ref_opt, ref_losses = _train(ref, plan, tmp_path / "dram", poison_step=1)
    engine, opt, losses = _train(model, dataclasses.replace(
        plan, state=StateHomes(optimizer=(2, 3))), tmp_path / "nvme", poison_step=1)
    assert opt.skipped_steps == ref_opt.skipped_steps == 1
    assert losses[:2] == ref_losses[:2] and losses[4:] == ref_losses[4:]
    engine.detach()
    _assert_same(model, ref, opt, ref_opt)


def test_a_replan_moving_masters_either_way_keeps_the_run_exact(tmp_path):
    """After the first step layers 1 and 2 are homed on NVMe; after the second, layer 1
    comes back to DRAM (read back for good) and layer 4 goes (after its next update)."""
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    _, ref_opt, ref_losses = _train(ref, plan, tmp_path / "dram", steps=4)
    engine = attach(model, plan, device=CPU, compute_dtype=torch.bfloat16,
                    nvme_dir=str(tmp_path / "nvme"))
    homes = {0: (1, 2), 1: (2, 4)}
    seen: list[list[int]] = []

    def between(engine, opt, step: int) -> None:
        seen.append(engine.masters.evicted_layers)
        if step in homes:
            engine.set_plan(dataclasses.replace(plan, state=StateHomes(optimizer=homes[step])))

    _, opt, losses = _train(model, plan, tmp_path, steps=4, between=between, engine=engine)
    assert seen == [[], [1, 2], [2, 4], [2, 4]]
    assert losses == ref_losses
    engine.detach()
    _assert_same(model, ref, opt, ref_opt)


def test_an_fp32_run_refuses_masters_on_nvme(tmp_path):
    model = build_model("llama", 2)
    plan = dataclasses.replace(make_plan("checkpoint_all", 2), state=StateHomes(optimizer=(1,)))
    with pytest.raises(ValueError, match="computes in fp32"):
        attach(model, plan, device=CPU, nvme_dir=str(tmp_path))


def test_state_dicts_read_the_files_and_a_load_goes_back_to_them(tmp_path):
    """`model.state_dict()` and `optimizer.state_dict()` hold the evicted layers' values,
    read from their files; a checkpoint loaded within `masters_in_dram` (masters in place,
    the optimizer's state replaced) trains on exactly as the all-DRAM run's load does."""
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    saved: dict[str, dict] = {}

    def save_then_load(key):
        def between(engine, opt, step: int) -> None:
            if step == 1:  # after the second step: save
                saved[key] = {"model": {k: v.clone() for k, v in
                                        engine.model.state_dict().items()},
                              "opt": copy.deepcopy(opt.state_dict())}
            if step == 2:  # after the third: back to the second's
                with engine.masters_in_dram(opt):
                    engine.model.load_state_dict(saved[key]["model"])
                    opt.load_state_dict(copy.deepcopy(saved[key]["opt"]))  # torch adopts them
        return between

    ref_engine, ref_opt, ref_losses = _train(ref, plan, tmp_path / "dram", steps=4,
                                             between=save_then_load("dram"))
    engine, opt, losses = _train(model, dataclasses.replace(
        plan, state=StateHomes(optimizer=(1, 2, 4), copies=(2,))), tmp_path / "nvme", steps=4,
        between=save_then_load("nvme"))
    for key, value in saved["dram"]["model"].items():
        assert torch.equal(value, saved["nvme"]["model"][key]), key
    for index, state in saved["dram"]["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, saved["nvme"]["opt"]["state"][index][name])
    assert engine.masters.evicted_layers == [1, 2, 4]
    assert losses == ref_losses
    engine.detach()
    ref_engine.detach()
    _assert_same(model, ref, opt, ref_opt)


def test_a_qlora_models_lora_masters_on_nvme_train_as_in_dram(tmp_path):
    """QLoRA: the frozen nf4 base stays packed in DRAM (no master, no moments); the LoRA
    adapters' masters and moments of every layer live on NVMe, bit for bit as in DRAM."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).parents[1] / "qa"))
    from test_qa_qlora import qlora

    plan = make_plan("megatrain", 4)
    runs = {}
    for name, homes in (("dram", StateHomes()), ("nvme", StateHomes(optimizer=(1, 2, 3, 4)))):
        model = qlora()
        engine, _, losses = _train(model, dataclasses.replace(plan, state=homes),
                                   tmp_path / name)
        evicted = engine.masters.evicted_layers
        engine.detach()
        runs[name] = losses, evicted, {n: p.detach().clone() for n, p in model.named_parameters()
                                       if p.requires_grad}
    assert runs["nvme"][1] == [1, 2, 3, 4] and runs["dram"][1] == []
    assert runs["nvme"][0] == runs["dram"][0]
    for name, value in runs["dram"][2].items():
        assert torch.equal(runs["nvme"][2][name], value), name


def test_a_failed_master_write_names_its_file_and_detach_still_cleans_up(tmp_path,
                                                                         monkeypatch):
    """Layer 2's masters and moments cannot be written after its update (EIO): the next
    update, which reads them back, fails naming `optim-2.bin` and the drive; `detach`
    says they are lost (resume from the last checkpoint) and still removes the files."""
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(optimizer=(2,)))
    engine = attach(model, plan, device=CPU, compute_dtype=torch.bfloat16,
                    nvme_dir=str(tmp_path))
    opt = HybridAdamW8bit(model.parameters(), lr=1e-2)
    ids = batches(1)[0]
    for step in range(2):
        if step == 1:
            fail_writes(monkeypatch, errno.EIO)  # layer 2's write after this update fails
        model(input_ids=ids, labels=ids).loss.backward()
        engine.step_layerwise(opt)
        engine.synchronize()
        opt.zero_grad()
    written = threading.Event()  # the write behind the update has run (and failed): on
    engine.masters._files.when_written(2, written.set)  # the emulated drive, after a jitter
    assert written.wait(timeout=30)
    monkeypatch.undo()
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="layer-wise optimizer update failed") as failed:
        engine.step_layerwise(opt)
        engine.synchronize()
    assert isinstance(failed.value.__cause__, StateIOError)
    assert "optim-2.bin" in str(failed.value.__cause__)
    directory = engine.spill.directories[0]
    with pytest.raises(RuntimeError, match=r"layers \[2\].*resume from the last checkpoint"):
        engine.detach()
    assert not directory.exists()


def test_the_updates_own_time_leaves_out_its_waits_for_the_drive(tmp_path, monkeypatch):
    """A drive slow to give back the homed layers' state (0.2 s a layer) makes the
    layer-wise update wait, not run: `optimizer_update_s`, whence the re-planner takes the
    host update's rate, stays below the waits (the drive's time is priced on its lanes)."""
    from lazytrain_accel.engine.memory.optimizer_files import NvmeMasters

    stage = NvmeMasters.stage

    def slow_stage(self, layer, *args):
        if layer in self.evicted_layers:
            time.sleep(0.2)
        return stage(self, layer, *args)

    monkeypatch.setattr(NvmeMasters, "stage", slow_stage)
    homes = StateHomes(optimizer=(1, 2, 3, 4))
    engine, _, _ = _train(build_model("llama", LAYERS), dataclasses.replace(
        make_plan("checkpoint_all", LAYERS), state=homes), tmp_path, steps=2)
    stats = engine.total_stats()
    engine.detach()
    assert stats.optimizer_wait_s >= 2 * len(homes.optimizer) * 0.2 * 0.9
    assert stats.optimizer_update_s < len(homes.optimizer) * 0.2
