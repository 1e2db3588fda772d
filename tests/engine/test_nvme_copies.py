"""The layers' compute copies homed on NVMe (`Plan.state.copies`, issue 44): written to a
file behind the update, their DRAM buffer dropped after each load and read back for the
next; the run is the all-DRAM run bit for bit, the files are gone at detach, and the part
the engine does not stream yet (masters and moments) is refused at attach."""

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
    twin,
)

from lazytrain_accel.engine import attach
from lazytrain_accel.optim import HybridAdamW8bit
from lazytrain_accel.planning.plan import StateHomes
from lazytrain_accel.storage.direct_io import StateIOError

CPU = torch.device("cpu")
LAYERS = 4


def _train(model, plan, tmp_path, steps: int = 3, after_step=None):
    """`steps` hybrid-8-bit steps with clipping in bf16; `after_step(engine, step)` after
    each. Returns the engine, the losses and, per step, which layers' copies were out of
    DRAM."""
    engine = attach(model, plan, device=CPU, compute_dtype=torch.bfloat16,
                    nvme_dir=str(tmp_path))
    opt = HybridAdamW8bit(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    losses, seen = [], []
    for step, ids in enumerate(batches(steps)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        engine.step_layerwise(opt)
        engine.synchronize()
        opt.zero_grad()
        seen.append({j: engine.pool._copies[j - 1] is None for j in range(1, LAYERS + 1)})
        if after_step is not None:
            after_step(engine, step)
    return engine, losses, seen


@pytest.mark.parametrize("kind", ["checkpoint_all", "all_nvme"])
def test_copies_on_nvme_train_bit_for_bit_as_in_dram_and_leave_no_file(tmp_path, kind):
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan(kind, LAYERS)
    ref_engine, ref_losses, _ = _train(ref, plan, tmp_path / "dram")
    copies = (1, 2, 4)
    engine, losses, seen = _train(
        model, dataclasses.replace(plan, state=StateHomes(copies=copies)), tmp_path / "nvme")
    assert losses == ref_losses
    files = sorted(p.name for p in engine.spill.directories[0].joinpath("state").iterdir())
    assert files == [f"copy-{j}.bin" for j in copies]
    numel = sum(p.numel() for p in engine.layer_params(1))
    assert (engine.spill.directories[0] / "state" / "copy-1.bin").stat().st_size == 2 * numel
    # after the backward's loads the NVMe-homed copies live in their files only (the
    # update then rewrote them in DRAM: every layer but the ones homed on NVMe keeps one)
    assert all(not seen[-1][j] for j in range(1, LAYERS + 1) if j not in copies)
    directory = engine.spill.directories[0]
    engine.detach()  # its I/O threads joined: every transfer counted
    ref_engine.detach()
    assert not directory.exists()
    # each step after the first: layers 1 and 2 read back once, for the backward (read
    # ahead: one load before), layer 4's backward reuses its forward's copy; 3 writes
    moved = engine.total_stats().transfer_bytes
    assert moved["state_nvme_read"] == 2 * 2 * (2 * numel), moved
    assert moved["state_nvme_write"] == 3 * len(copies) * (2 * numel), moved
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def _layer_2_copy_on_nvme_after_a_backward(tmp_path):
    """A bf16 engine whose plan homes layer 2's copy on NVMe, one backward done: (model,
    engine, its hybrid optimizer, the batch)."""
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(copies=(2,)))
    engine = attach(model, plan, device=CPU, compute_dtype=torch.bfloat16,
                    nvme_dir=str(tmp_path))
    opt = HybridAdamW8bit(model.parameters(), lr=1e-2)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    return model, engine, opt, ids


def test_a_failed_copy_write_says_what_to_do_and_the_engine_still_detaches(tmp_path,
                                                                            monkeypatch):
    model, engine, opt, ids = _layer_2_copy_on_nvme_after_a_backward(tmp_path)
    fail_writes(monkeypatch, errno.EIO)
    engine.step_layerwise(opt)
    engine.synchronize()  # the update wrote layer 2's copy; its file's write failed
    with pytest.raises(StateIOError, match=r"copy-2\.bin.*dmesg"):  # at its next use
        model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.undo()
    detach_leaves_no_files(engine)


def test_plans_the_engine_cannot_run_are_refused_at_attach(tmp_path):
    model = build_model("llama", LAYERS)
    plan = dataclasses.replace(make_plan("checkpoint_all", LAYERS),
                               state=StateHomes(copies=(1,)))
    with pytest.raises(ValueError, match="computes in fp32"):
        attach(model, plan, device=CPU, nvme_dir=str(tmp_path))


def test_a_replan_homing_more_copies_on_nvme_keeps_the_run_exact(tmp_path):
    """Layer 3 homed on NVMe by a new plan after its copy was written to DRAM only: its
    buffer stays until its file holds that copy (written at its next update)."""
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    plan = make_plan("checkpoint_all", LAYERS)
    _, ref_losses, _ = _train(ref, plan, tmp_path / "dram", steps=4)

    def replan(engine, step: int) -> None:
        if step == 1:
            engine.set_plan(dataclasses.replace(plan, state=StateHomes(copies=(1, 3))))

    engine, losses, _ = _train(model, dataclasses.replace(plan, state=StateHomes(copies=(1,))),
                               tmp_path / "nvme", steps=4, after_step=replan)
    assert losses == ref_losses
    engine.detach()


def test_the_forward_never_waits_for_a_copys_write(tmp_path, monkeypatch):
    """The update writes a copy to its file behind; the next forward loads the copy from
    its DRAM buffer and lets it go without waiting for that write (its bytes stay
    counted until the write ends); the backward's read back waits for it."""
    import threading
    import time

    from lazytrain_accel.storage import direct_io

    model, engine, opt, ids = _layer_2_copy_on_nvme_after_a_backward(tmp_path)
    release = threading.Event()
    pwrite = direct_io.os.pwrite

    def held(*args, **kwargs):
        release.wait()
        return pwrite(*args, **kwargs)

    monkeypatch.setattr(direct_io.os, "pwrite", held)
    engine.step_layerwise(opt)
    engine.synchronize()  # the update is done; layer 2's copy is being written, held
    out: list = []
    forward = threading.Thread(target=lambda: out.append(model(input_ids=ids, labels=ids)),
                               daemon=True)
    forward.start()
    forward.join(timeout=30)
    waited = forward.is_alive()
    held_bytes = engine.stats().current_bytes["host_pageable"]
    release.set()
    forward.join()
    assert not waited, "the forward waited for the copy's write"
    assert engine.pool._copies[1] is None  # let go after its load
    engine.pool._nvme.wait_written(2)  # its bytes counted until the write ended (freed
    copy_bytes = 2 * sum(p.numel() for p in engine.layer_params(2))  # by its callback)
    deadline = time.monotonic() + 10
    while engine.stats().current_bytes["host_pageable"] != held_bytes - copy_bytes \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().current_bytes["host_pageable"] == held_bytes - copy_bytes
    out[0].loss.backward()  # layer 2's read back waits for the write, then reads it
    monkeypatch.undo()
    detach_leaves_no_files(engine)
