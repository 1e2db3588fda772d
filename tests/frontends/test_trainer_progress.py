"""`LazyTrainCallback` prints a plain progress line when stdout is not a terminal."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from lazytrain_accel.frontends.trainer_callback import LazyTrainCallback
from lazytrain_accel.progress import PROGRESS_EVERY_STEPS


def _trainer(stall_s: list[float]) -> SimpleNamespace:
    plan = SimpleNamespace(batch_size=4, seq_len=16, prediction=SimpleNamespace(step_s=0.5))
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(stall_s=stall_s[0]), plan=plan)
    accelerator = SimpleNamespace(lazytrain=SimpleNamespace(
        run=SimpleNamespace(plan=plan), engine=engine, replanner=None, guard=None))
    # The Trainer's loss accumulator since its last log (what its next log reports).
    return SimpleNamespace(accelerator=accelerator, _tr_loss=torch.tensor(0.0),
                           _globalstep_last_logged=0)


def test_a_line_every_few_steps_off_a_terminal(tmp_path, capsys: pytest.CaptureFixture) -> None:
    stall = [0.0]
    trainer = _trainer(stall)
    callback = LazyTrainCallback(trainer)
    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2,
                             report_to=[])
    state, control = TrainerState(max_steps=2 * PROGRESS_EVERY_STEPS), TrainerControl()
    for step in range(1, state.max_steps + 1):
        state.global_step = step
        callback.on_step_begin(args, state, control)
        stall[0] += 0.001  # the engine's stall counter grows by 1 ms a step
        trainer._tr_loss += 2.5  # every step's loss is 2.5
        callback.on_step_end(args, state, control)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["1/20", "10/20", "20/20"]
    assert lines[1].startswith("lazytrain: step 10/20  loss 2.5000  ")
    assert "stall 1.0 ms" in lines[1]
    assert lines[1].endswith("(predicted 1.000 s)")  # two micro-batches per step


def test_the_trainer_still_has_the_loss_accumulator_read_here() -> None:
    source = inspect.getsource(Trainer)
    assert "self._tr_loss" in source and "self._globalstep_last_logged" in source
