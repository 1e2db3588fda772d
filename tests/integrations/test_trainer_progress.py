"""`LazyTrainCallback` prints a plain progress line when stdout is not a terminal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from lazytrain_accel.integrations.trainer_callback import LazyTrainCallback
from lazytrain_accel.progress import PROGRESS_EVERY_STEPS


def _callback(stall_s: list[float]) -> LazyTrainCallback:
    plan = SimpleNamespace(batch_size=4, seq_len=16, prediction=SimpleNamespace(step_s=0.5))
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(stall_s=stall_s[0]))
    accelerator = SimpleNamespace(lazytrain_run=SimpleNamespace(plan=plan),
                                  lazytrain_engine=engine)
    return LazyTrainCallback(SimpleNamespace(accelerator=accelerator))


def test_a_line_every_few_steps_off_a_terminal(tmp_path, capsys: pytest.CaptureFixture) -> None:
    stall = [0.0]
    callback = _callback(stall)
    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2,
                             report_to=[])
    state, control = TrainerState(max_steps=2 * PROGRESS_EVERY_STEPS), TrainerControl()
    state.log_history.append({"loss": 2.5, "step": 0})
    for step in range(1, state.max_steps + 1):
        state.global_step = step
        callback.on_step_begin(args, state, control)
        stall[0] += 0.001  # the engine's stall counter grows by 1 ms a step
        callback.on_step_end(args, state, control)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["1/20", "10/20", "20/20"]
    assert lines[1].startswith("lazytrain: step 10/20  last logged loss 2.5000  ")
    assert "stall 1.0 ms" in lines[1]
    assert lines[1].endswith("(predicted 1.000 s)")  # two micro-batches per step
