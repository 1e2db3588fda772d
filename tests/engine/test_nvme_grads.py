"""The layers' gradients homed on NVMe (`Plan.state.grads`, issue 44): written to a file
once folded (norms recorded), read back for the layer's update and for the next
micro-batch's fold; the run is the all-DRAM run bit for bit (clipping, accumulation, a
skipped step, a re-plan), and a failed write names its file at the next use."""

from __future__ import annotations

import dataclasses
import errno

import pytest
import torch
from engine_helpers import (
    batches,
    build_model,
    detach_leaves_no_files,
    fail_writes,
    make_plan,
    train_clipped,
    twin,
)

from lazytrain_accel.engine import attach
from lazytrain_accel.optim import HybridAdamW8bit
from lazytrain_accel.planning.plan import StateHomes
from lazytrain_accel.storage.direct_io import StateIOError

CPU = torch.device("cpu")
LAYERS = 4
MICRO_BATCHES = 2


def _train(model, plan, tmp_path, **kwargs):
    """`train_clipped`: 3 steps of `MICRO_BATCHES` micro-batches."""
    return train_clipped(model, plan, tmp_path, micro_batches=MICRO_BATCHES, **kwargs)


def _assert_same_weights(model, ref) -> None:
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_on_nvme_train_bit_for_bit_as_in_dram(tmp_path, dtype):
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    ref_engine, _, ref_losses = _train(ref, plan, tmp_path / "dram", dtype=dtype)
    homed = (1, 3, 4)
    norms: list[dict] = []

    def between(engine, step: int) -> None:
        # the backward left the homed layers' gradients in their files only; their norms
        # are the engine's, for the clip
        for j in range(1, LAYERS + 1):
            assert all((p.grad is None) == (j in homed) for p in engine.layer_params(j))
        norms.append(engine.grad_sq_norms())

    engine, _, losses = _train(model, dataclasses.replace(plan, state=StateHomes(grads=homed)),
                               tmp_path / "nvme", dtype=dtype, after_backward=between)
    assert losses == ref_losses
    assert all(set(n) == set(norms[0]) for n in norms)
    assert {p for j in homed for p in engine.layer_params(j)} <= set(norms[0])
    state = engine.spill.directories[0] / "state"
    assert sorted(p.name for p in state.iterdir()) == [f"grad-{j}.bin" for j in homed]
    numel = sum(p.numel() for p in engine.layer_params(1))
    assert (state / "grad-1.bin").stat().st_size == 4 * numel
    directory = engine.spill.directories[0]
    engine.detach()
    ref_engine.detach()
    assert not directory.exists()
    # per step and homed layer: a write per micro-batch; a read for the second
    # micro-batch's fold and one for the update
    moved = engine.total_stats().transfer_bytes
    assert moved["state_nvme_write"] == 3 * len(homed) * MICRO_BATCHES * 4 * numel, moved
    assert moved["state_nvme_read"] == 3 * len(homed) * 2 * 4 * numel, moved
    _assert_same_weights(model, ref)


def test_a_skipped_step_drops_the_grads_in_files(tmp_path):
    """The non-finite step is skipped and counted; its gradients (in files) do not leak
    into the next step, which trains as the all-DRAM run's does."""
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    _, ref_opt, _ = _train(ref, plan, tmp_path / "dram", poison_step=1)
    engine, opt, _ = _train(model, dataclasses.replace(plan, state=StateHomes(grads=(2, 3))),
                            tmp_path / "nvme", poison_step=1)
    assert opt.skipped_steps == ref_opt.skipped_steps == 1
    assert not engine.sink.files.pending
    engine.detach()
    _assert_same_weights(model, ref)


def test_a_replan_moving_grads_mid_accumulation_keeps_the_run_exact(tmp_path):
    """Between two micro-batches of a step a new plan homes other layers' gradients:
    layer 1's come back from its file to `.grad`, layer 3's go to one at its next fold."""
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    _, _, ref_losses = _train(ref, plan, tmp_path / "dram")
    nvme = dataclasses.replace(plan, state=StateHomes(grads=(1, 2)))
    engine = attach(model, nvme, device=CPU, nvme_dir=str(tmp_path / "nvme"))
    opt = HybridAdamW8bit(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    losses = []
    data = batches(3 * MICRO_BATCHES)
    for k, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss / MICRO_BATCHES
        loss.backward()
        losses.append(loss.item())
        if k == 2:  # the second step's first micro-batch is in files (layers 1, 2)
            engine.set_plan(dataclasses.replace(plan, state=StateHomes(grads=(2, 3))))
            assert all(p.grad is not None for p in engine.layer_params(1))
        if k % MICRO_BATCHES == MICRO_BATCHES - 1:
            engine.step_layerwise(opt)
            engine.synchronize()
            opt.zero_grad()
    assert losses == ref_losses
    engine.detach()
    _assert_same_weights(model, ref)


def test_a_failed_grad_write_names_its_file_and_the_engine_still_detaches(tmp_path,
                                                                          monkeypatch):
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(grads=(2,)))
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    opt = HybridAdamW8bit(model.parameters(), lr=1e-2)
    fail_writes(monkeypatch, errno.ENOSPC)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()  # layer 2's write fails behind
    with pytest.raises(RuntimeError, match="layer-wise optimizer update failed") as failed:
        engine.step_layerwise(opt)
        engine.synchronize()
    assert isinstance(failed.value.__cause__, StateIOError)
    assert "grad-2.bin" in str(failed.value.__cause__)
    assert "nvme" in str(failed.value.__cause__).lower()
    monkeypatch.undo()
    detach_leaves_no_files(engine)


def test_gradients_reduced_across_ranks_are_refused_on_nvme(tmp_path):
    """A data-parallel hook reads a layer's gradients after the fold: they stay in DRAM."""
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(grads=(1,)))
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    with pytest.raises(ValueError, match="host_state='copies'"):
        engine.register_grad_ready_hook(lambda params: None)
    engine.detach()


@pytest.mark.parametrize("zero", ["model", "optimizer"])
def test_a_zero_grad_between_micro_batches_drops_the_grads_in_files(tmp_path, zero):
    """`zero_grad()` of the model or of the optimizer after a micro-batch: the gradients
    in files are gone as those in `.grad`, the step applies the next micro-batch only."""
    def run(model, plan, where):
        engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path / where))
        opt = HybridAdamW8bit(model.parameters(), lr=1e-2, max_grad_norm=1.0)
        engine.steps.adopt(opt)  # as prepare does (else at its first step)
        first, second = batches(2)
        model(input_ids=first, labels=first).loss.backward()
        (model if zero == "model" else opt).zero_grad()
        model(input_ids=second, labels=second).loss.backward()
        engine.step_layerwise(opt)
        engine.synchronize()
        engine.detach()

    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    run(ref, plan, "dram")
    run(model, dataclasses.replace(plan, state=StateHomes(grads=(1, 2, 3, 4))), "nvme")
    _assert_same_weights(model, ref)


def test_a_written_gradient_leaves_dram(tmp_path, monkeypatch):
    """Once its write is done a homed layer's gradient is held by nothing: the DRAM it
    took is free until the update reads the file back (a reference kept until then would
    hold every homed layer's gradients through the step: the budget's overshoot)."""
    import gc
    import weakref

    from lazytrain_accel.engine.memory.grad_files import NvmeGrads

    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(grads=(1, 2, 3)))
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    spilled: list[weakref.ref] = []
    spill = NvmeGrads.spill

    def watched(self, layer: int) -> None:
        buffer = self._open[layer]  # the one the layer's `.grad` are views of
        assert all(p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                   for p in self._params[layer - 1])
        spilled.append(weakref.ref(buffer))
        spill(self, layer)

    monkeypatch.setattr(NvmeGrads, "spill", watched)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in (1, 2, 3):
        engine.sink.files.wait_written(layer)
    gc.collect()
    assert len(spilled) == 3
    assert all(ref() is None for ref in spilled)
    engine.detach()


def test_the_state_io_counts_the_drives_busy_time_not_each_requests(monkeypatch, tmp_path):
    """Two reads overlapping from t=1 to t=3: 4 s busy (the union), where the requests'
    own spans sum to 6; bytes are counted for requests that end whole."""
    from lazytrain_accel.engine.memory import state_io
    from lazytrain_accel.engine.stats import Accounting

    clock = iter([0.0, 1.0, 3.0, 4.0, 10.0, 11.0])
    monkeypatch.setattr(state_io.time, "perf_counter", lambda: next(clock))
    acct = Accounting()
    io = state_io.StateIO(acct)
    io._event(state_io.READ, +1, 0)  # t=0
    io._event(state_io.READ, +1, 0)  # t=1
    io._event(state_io.READ, -1, 100)  # t=3
    io._event(state_io.READ, -1, 50)  # t=4
    io._event(state_io.WRITE, +1, 0)  # t=10
    io._event(state_io.WRITE, -1, 0)  # t=11: failed, no bytes
    totals = acct.totals()
    assert totals.transfer_s[state_io.READ] == 4.0
    assert totals.transfer_bytes[state_io.READ] == 150
    assert (totals.transfer_s[state_io.WRITE], totals.transfer_bytes[state_io.WRITE]) == (1.0, 0)


def test_a_layer_staged_out_of_the_updates_order_is_read_once(tmp_path):
    """`stage` of a layer whose read the update's order had not issued yet reads it now,
    and the read-ahead does not read it again."""
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(grads=(1, 2, 3, 4)))
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    files = engine.sink.files
    files.begin_update([1, 2, 3, 4])  # three buffers: layers 1-3 read ahead, 4 queued
    assert sorted(files._reads) == [1, 2, 3]
    files.stage(4)
    assert all(p.grad is not None for p in engine.layer_params(4))
    for layer in (4, 1, 2, 3):
        files.stage(layer)
        files.unstage(layer)
    files.end_update()
    assert not files.pending and not files._reads
    engine.detach()


def test_a_layers_gradients_move_from_one_aligned_buffer_without_bounce_copies(
        tmp_path, monkeypatch):
    """Each homed layer's gradients are folded into one aligned buffer and written, read
    back and read ahead from it whole: only a file's sub-block tail passes through the
    direct I/O's request buffers, whose other pages are never touched (the host model does
    not count them as resident)."""
    from lazytrain_accel.storage import direct_io

    bounced: list[int] = []
    stock_move = direct_io.ctypes.memmove
    monkeypatch.setattr(direct_io.ctypes, "memmove",
                        lambda *args: bounced.append(args[2]) or stock_move(*args))
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(grads=(1, 2, 3)))
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    for ids in batches(2):  # the second micro-batch reads the first's back and adds
        model(input_ids=ids, labels=ids).loss.backward()
    files = engine.sink.files
    files.begin_update([1, 2, 3])
    for layer in (1, 2, 3):
        files.stage(layer)
        files.unstage(layer)
    files.end_update()
    assert len(engine.layer_params(1)) > 4  # per-parameter writes would bounce more
    # 3 layers x (2 writes, a read-back, the update's read): at most one tail each
    assert len(bounced) <= 3 * 4
    assert all(nbytes < direct_io.BLOCK_BYTES for nbytes in bounced)
    engine.detach()
