"""Non-finite gradients: each bad step is skipped whole and counted; N in a row stop
training with an error naming where the first bad gradient appeared."""

from __future__ import annotations

import copy

import pytest
import torch
from fault_helpers import loader, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.run.step_guard import NonFiniteGradientError


class _InfInBackward(torch.autograd.Function):
    """Identity forward; an inf gradient in backward (an overflow inside layer 2's MLP)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def _snapshot(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer
              ) -> tuple[list, dict]:
    acc.wait_for_everyone()  # optimizer state read directly: let the layer-wise update end
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}
    return [p.detach().clone() for p in model.parameters()], state


def _same(a: tuple[list, dict], b: tuple[list, dict]) -> bool:
    weights = all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    states = a[1].keys() == b[1].keys() and all(
        (torch.equal(v, b[1][i][k]) if torch.is_tensor(v) else v == b[1][i][k])
        for i, s in a[1].items() for k, v in s.items())
    return weights and states


@pytest.mark.parametrize("optimizer", ["hybrid8bit", "keep"])
def test_bad_steps_are_skipped_counted_and_three_in_a_row_stop(tmp_path, optimizer) -> None:
    model = tiny_model()
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", optimizer=optimizer,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, data = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   loader())
    batch = next(iter(data))[0]
    inject = {"on": False}

    def overflow(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        return _InfInBackward.apply(out) if inject["on"] else out

    model.model.layers[1].mlp.register_forward_hook(overflow)

    def step(bad: bool) -> None:
        inject["on"] = bad
        acc.backward(model(input_ids=batch, labels=batch).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step(bad=False)
    after_good = _snapshot(acc, model, opt.optimizer)
    step(bad=True)
    step(bad=True)
    assert _same(_snapshot(acc, model, opt.optimizer), after_good)  # nothing applied
    step(bad=False)  # a good step resets the streak
    after_second_good = _snapshot(acc, model, opt.optimizer)
    assert not _same(after_second_good, after_good)
    step(bad=True)
    step(bad=True)
    with pytest.raises(NonFiniteGradientError) as info:
        step(bad=True)
    text = str(info.value)
    # Backward runs from the head down: layers 3-4 and the head stay finite, the first
    # bad gradient is in layer 2 (index 1), where the overflow happened.
    assert "first bad gradient was in decoder layer 2 (model.layers.1), parameter " \
           "model.layers.1." in text, text
    assert "3 consecutive" in text and "steps 5..7" in text and "after step 4" in text
    assert _same(_snapshot(acc, model, opt.optimizer), after_second_good)
    guard = acc.lazytrain.guard
    assert (guard.steps, guard.skipped_steps, guard.consecutive_skips) == (7, 5, 3)
    if optimizer == "hybrid8bit":
        assert opt.optimizer.skipped_steps == 5
    acc.end_training()


def test_the_limit_comes_from_the_plugin(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_MAX_NONFINITE_SKIPS", "1")
    model = tiny_model()
    twin = copy.deepcopy(model)
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, data = acc.prepare(model, torch.optim.AdamW(model.parameters()), loader())
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")  # a corrupted weight: nan loss
    batch = next(iter(data))[0]
    acc.backward(model(input_ids=batch, labels=batch).loss)
    with pytest.raises(NonFiniteGradientError, match="1 consecutive optimizer steps"):
        opt.step()
    for ours, theirs in zip(model.model.layers.parameters(), twin.model.layers.parameters(),
                            strict=True):
        assert torch.equal(ours, theirs)  # skipped: no layer was updated
    acc.end_training()


def test_a_skipped_step_does_not_advance_the_lr_schedule(tmp_path) -> None:
    import warnings

    model = tiny_model()
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    model, opt, data, scheduler = acc.prepare(model, optimizer, loader(), scheduler)
    batch = next(iter(data))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss * float("inf"))
        opt.step()
        scheduler.step()
        opt.zero_grad()
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # not advanced
    acc.backward(model(input_ids=batch, labels=batch).loss)
    opt.step()
    scheduler.step()
    assert not opt.step_was_skipped
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    acc.end_training()
