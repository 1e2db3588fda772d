"""Skipped steps are counted in one place (issue 31): what decides a step counts it once
(`HybridAdamW8bit.begin_step`, or the run's step for a kept optimizer) in the run's one
`SkipCount`, and every reporter reads that count."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import lazytrain_accel
from lazytrain_accel import Accelerator, LazyTrainPlugin

STEPS, BAD_STEP = 4, 1


def _tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


@pytest.mark.parametrize("optimizer", ["hybrid8bit", "keep"])
def test_a_nonfinite_step_counts_one_skip_in_every_reporter(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, optimizer: str) -> None:
    """One step of four with an inf gradient: one skip for the guard, for the optimizer
    (the same `SkipCount` object), in the warnings, and in accelerate's per-step flag
    (what its LR schedulers and the Trainer read)."""
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", optimizer=optimizer,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model = _tiny_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    was_skipped = []
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        for step in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss * float("inf") if step == BAD_STEP else loss)
            opt.step()
            opt.zero_grad()
            was_skipped.append(acc.optimizer_step_was_skipped)
    acc.wait_for_everyone()
    guard = acc.lazytrain.guard
    assert was_skipped == [step == BAD_STEP for step in range(STEPS)]
    assert (guard.steps, guard.skipped_steps, guard.consecutive_skips) == (STEPS, 1, 0)
    if optimizer == "hybrid8bit":
        assert opt.optimizer.skips is guard.skips and opt.optimizer.skipped_steps == 1
    warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and "1 skipped in this run" in warnings[0], warnings
    acc.end_training()


def test_skipped_steps_are_added_up_at_one_site() -> None:
    """Grep-able: one `+= 1` of a skip count in the package, `SkipCount.add`'s."""
    package = Path(lazytrain_accel.__file__).parent
    sites = [f"{path.relative_to(package).as_posix()}:{number}"
             for path in sorted(package.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if re.search(r"skip\w*\s*\+=", line)]
    assert len(sites) == 1 and sites[0].startswith("optim/skip_count.py:"), sites
