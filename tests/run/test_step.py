"""`OptimizerStep.shares`, the one hook for the other ranks' shares of the gradients (a
node store's reducer): the hybrid operator's global norm and a kept optimizer's finite
check both read it, once a step, on every rank (issue 31: two hooks before)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.run.step import installed_step

OTHER_RANKS = "a parameter another rank owns"


class _Shares:
    """What a node store's reducer reports: every gradient's norm, the first parameter's
    as another rank holds it (`foreign_sq_norm`: its squared norm there)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.foreign_sq_norm = 1.0
        self.asked = 0

    def grad_norm_tables(self) -> tuple[dict[nn.Parameter, float], dict[nn.Parameter, float]]:
        self.asked += 1
        measured = {p: float(p.grad.norm()) for p in self.params[1:] if p.grad is not None}
        return measured, {self.params[0]: self.foreign_sq_norm}

    def global_grad_sq_norm(self) -> float:
        measured, sq = self.grad_norm_tables()
        return sum(n * n for n in measured.values()) + sum(sq.values())


def _prepared(tmp_path: Path, optimizer: str) -> tuple[Accelerator, nn.Module, object, _Shares]:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", optimizer=optimizer,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    shares = _Shares(list(model.parameters()))
    installed_step(opt.optimizer).shares = shares  # as the run wires a node store's reducer
    return acc, model, opt, shares


def _step(acc: Accelerator, model: nn.Module, opt: object, *, scale: float = 1.0,
          clip: bool = False) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    acc.backward(model(input_ids=ids, labels=ids).loss * scale)
    if clip:
        acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _skip_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]


@pytest.mark.parametrize("optimizer", ["hybrid8bit", "keep"])
def test_another_ranks_nonfinite_share_skips_the_step_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, optimizer: str) -> None:
    acc, model, opt, shares = _prepared(tmp_path, optimizer)
    _step(acc, model, opt)
    shares.foreign_sq_norm = math.inf  # finite here, not on the rank owning params[0]
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        _step(acc, model, opt)
    assert acc.optimizer_step_was_skipped and acc.lazytrain.guard.skipped_steps == 1
    (warning,) = _skip_warnings(caplog)
    assert f"in {OTHER_RANKS} at optimizer step 2" in warning, warning
    assert shares.asked == 2  # once a step
    if optimizer == "hybrid8bit":
        assert opt.optimizer.skipped_steps == 1 and math.isinf(opt.optimizer.last_grad_norm)
    acc.end_training()


def test_the_hybrid_norm_is_the_shares_and_a_clip_sets_it_for_the_step(
        tmp_path: Path) -> None:
    """The global norm combines the shares' tables in one process's order; after
    `clip_grad_norm_` read them, the step does not ask again (one collective a step)."""
    acc, model, opt, shares = _prepared(tmp_path, "hybrid8bit")
    shares.foreign_sq_norm = 4.0
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    grads = [p.grad.norm() for p in shares.params[1:] if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([*grads, torch.tensor(2.0)]))
    assert float(acc.clip_grad_norm_(model.parameters(), 1.0)) == pytest.approx(
        float(expected), rel=1e-6)
    opt.step()
    opt.zero_grad()
    assert shares.asked == 1 and not acc.optimizer_step_was_skipped
    _step(acc, model, opt)  # no clip: the step asks
    assert shares.asked == 2
    acc.end_training()


def test_a_kept_optimizer_asks_the_shares_even_when_its_own_gradient_is_bad(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The shares' norm is a collective: every rank calls it each step, also one whose
    own share is non-finite (skipping the call would pair the ranks' collectives
    wrongly); the step names the local parameter (the head's, first in backward order)."""
    acc, model, opt, shares = _prepared(tmp_path, "keep")
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        _step(acc, model, opt, scale=math.inf)
    assert shares.asked == 1 and acc.lazytrain.guard.skipped_steps == 1
    (warning,) = _skip_warnings(caplog)
    assert OTHER_RANKS not in warning and "lm_head.weight" in warning, warning
    acc.end_training()
