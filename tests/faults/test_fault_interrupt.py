"""Ctrl-C (a real SIGINT to this process) during training: the step in progress finishes,
training stops at that boundary, no NVMe file is left, and the Trainer saves a checkpoint
when saving is on. A second Ctrl-C stops at once."""

from __future__ import annotations

import copy
import gc
import os
import signal
from pathlib import Path

import pytest
import torch
from fault_helpers import loader, plan_json, tiny_model
from transformers import TrainerCallback

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.frontends.transformers import (
    LazyTrainTrainer,
    LazyTrainTrainingArguments,
)
from lazytrain_accel.planning.plan import Home
from lazytrain_accel.run.step_guard import TrainingInterrupted


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler during each test, whatever the runner inherited: a
    process started in the background by a non-interactive shell (nohup, `cmd &`) begins
    with SIGINT ignored, and the guard restores the handler it found."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def _nvme_run(tmp_path: Path, model: torch.nn.Module) -> tuple[Accelerator, object, object]:
    plugin = LazyTrainPlugin(plan=plan_json(tmp_path, model, Home.NVME), hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, data = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   loader())
    return acc, opt, data


def _sigint_during_forward(model: torch.nn.Module, at_call: int, times: int = 1) -> None:
    calls = {"n": 0}

    def hook(*_: object) -> None:
        calls["n"] += 1
        if calls["n"] == at_call:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)

    model.model.layers[2].register_forward_hook(hook)


def test_ctrl_c_stops_after_the_step_in_progress(tmp_path) -> None:
    model = tiny_model()
    reference = copy.deepcopy(model)
    acc, opt, data = _nvme_run(tmp_path, model)
    _sigint_during_forward(model, at_call=2)  # in step 2's forward, at layer 3
    done = 0
    with pytest.raises(TrainingInterrupted, match="after optimizer step 2, which was applied"):
        for (batch,) in data:
            acc.backward(model(input_ids=batch, labels=batch).loss)
            opt.step()
            opt.zero_grad()
            done += 1
    assert done == 1  # step 2 raised from opt.step(), after its update
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not list((tmp_path / "nvme").rglob("*.bin"))
    # step 2 was applied whole: the weights equal two plain steps of the same optimizer
    ref_acc = Accelerator(cpu=True, plugin=LazyTrainPlugin(
        plan="checkpoint_all", hardware="h800", cache_dir=str(tmp_path / "cache2"),
        nvme_dir=str(tmp_path / "nvme2")))
    reference, ref_opt, ref_data = ref_acc.prepare(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), loader())
    for _, (batch,) in zip(range(2), ref_data, strict=False):
        ref_acc.backward(reference(input_ids=batch, labels=batch).loss)
        ref_opt.step()
        ref_opt.zero_grad()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    acc.end_training()
    ref_acc.end_training()


def test_second_ctrl_c_interrupts_at_once_and_leaves_no_file(tmp_path) -> None:
    model = tiny_model()
    acc, opt, data = _nvme_run(tmp_path, model)
    _sigint_during_forward(model, at_call=1, times=2)
    (batch,) = next(iter(data))
    with pytest.raises(KeyboardInterrupt) as info:
        acc.backward(model(input_ids=batch, labels=batch).loss)
    assert type(info.value) is KeyboardInterrupt  # not the step-boundary kind
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # The abandoned forward's files go when the engine drops it: at the next pass (or at
    # exit, when the interrupt ends the script); the traceback must not keep it alive.
    del info
    gc.collect()
    acc.backward(model(input_ids=batch, labels=batch).loss)
    opt.step()
    acc.lazytrain.engine.synchronize()
    assert not list((tmp_path / "nvme").rglob("*.bin"))
    acc.end_training()


class _CtrlCAtStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_trainer_stops_at_the_boundary_and_saves_a_checkpoint(tmp_path) -> None:
    ids = torch.arange(16 * 12).reshape(16, 12) % 64
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = LazyTrainTrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", lazytrain=True,
        per_device_train_batch_size=4, max_steps=4, save_strategy="steps", save_steps=100,
        logging_steps=100)
    trainer = LazyTrainTrainer(
        model=tiny_model(), args=args, train_dataset=data, callbacks=[_CtrlCAtStep(2)],
        lazytrain_config={"plan": plan_json(tmp_path, tiny_model(), Home.NVME),
                          "hardware": "h800", "cache_dir": str(tmp_path / "cache"),
                          "nvme_dir": str(tmp_path / "nvme")})
    trainer.train()
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "model.safetensors").is_file()
    assert not list((tmp_path / "nvme").rglob("*.bin"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
