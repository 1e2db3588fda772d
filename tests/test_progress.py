"""Plain progress lines for logs (no terminal): when they come and what they say."""

from __future__ import annotations

import io

import pytest

from lazytrain_accel.progress import PlainProgress, is_terminal


def test_a_line_at_the_first_every_nth_and_the_last_step() -> None:
    progress = PlainProgress(total_steps=25, every_steps=10)
    lines = {step: progress.step_done(step, step_s=0.25, stall_s=0.002, tokens=1000, loss=1.5,
                                     predicted_step_s=0.5)
             for step in range(1, 26)}
    assert [s for s, line in lines.items() if line] == [1, 10, 20, 25]
    assert lines[10] == ("step 10/25  loss 1.5000  4,000 tok/s  stall 2.0 ms  "
                         "step 0.250 s (predicted 0.500 s)")


def test_averages_cover_only_the_steps_since_the_previous_line() -> None:
    progress = PlainProgress(total_steps=None, every_steps=2, loss_label="last logged loss")
    progress.step_done(1, step_s=9.0, stall_s=0.0, tokens=9, loss=None,  # its own line
                       predicted_step_s=1.0)
    assert progress.step_done(2, step_s=1.0, stall_s=0.0, tokens=100, loss=None,
                              predicted_step_s=0.8) == (
        "step 2  last logged loss -  100 tok/s  stall 0.0 ms  step 1.000 s (predicted 0.800 s)")


def test_a_string_buffer_is_not_a_terminal_and_every_steps_is_checked() -> None:
    assert not is_terminal(io.StringIO())
    with pytest.raises(ValueError, match="every_steps=0"):
        PlainProgress(total_steps=1, every_steps=0)
