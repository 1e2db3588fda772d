"""The plugin's default step (optimizer="hybrid8bit") overlaps the layer-wise update with
the next forward, and trains exactly what the stock Accelerator trains with the same
operator: accumulation, clipping, decay groups, an LR schedule, padding and dropout."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import build_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.optim import HybridAdamW8bit

VOCAB = 96  # engine_helpers' vocabulary
#: The families of the engine's equivalence suite, with dropout on where their configs
#: have a knob for it (the others drop out by default or not at all).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gpt_neox", "opt", "gpt2")
_OVERRIDES: dict[str, dict[str, Any]] = {"phi3": {"resid_pdrop": 0.1}}


def _build(arch: str, num_layers: int = 4) -> nn.Module:
    return build_model(arch, num_layers, use_cache=False, **_OVERRIDES.get(arch, {}))


def _loader(num: int = 8, seq: int = 12) -> torch.utils.data.DataLoader:
    ids = torch.randint(3, VOCAB, (num, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row in range(1, num, 2):
        ids[row, -row % 4 - 1:] = 0
        mask[row, -row % 4 - 1:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    samples = [dict(input_ids=ids[i], attention_mask=mask[i], labels=labels[i])
               for i in range(num)]
    return torch.utils.data.DataLoader(samples, batch_size=2)


def _plugin(tmp_path: Path, **kwargs: Any) -> LazyTrainPlugin:
    return LazyTrainPlugin(plan="megatrain", hardware="h800", cache_dir=str(tmp_path / "c"),
                           nvme_dir=str(tmp_path / "n"), **kwargs)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _train(model: nn.Module, plugin: LazyTrainPlugin | None, *, epochs: int = 1,
           mixed_precision: str = "no", on_prepared: Callable[[Any], Any] | None = None
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A user's loop: accumulate 2, clip 0.5, decay groups, LR schedule, dropout on.

    The stock run clips inside the operator too (`max_grad_norm`), as the plugin's
    `clip_grad_norm_` makes it do: torch's clip_grad_norm_ would sum the norm over
    `model.parameters()` in another order and differ in the last bit."""
    optimizer = HybridAdamW8bit(_groups(model), lr=1e-2,
                                max_grad_norm=0.5 if plugin is None else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    if plugin is None:
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2,
                                     mixed_precision=mixed_precision)
    else:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, plugin=plugin,
                          mixed_precision=mixed_precision)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, _loader(), scheduler)
    if on_prepared is not None:
        on_prepared(acc)
    losses = []
    torch.manual_seed(5)  # the same dropout masks in every run
    for _ in range(epochs):
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                losses.append(loss.item())
                if acc.sync_gradients and plugin is not None:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    # Read right after the last step, as scripts do: parameters() waits for the update.
    params = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}
    acc.end_training()
    return losses, params


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_overlapped_step_equals_the_stock_accelerator_bit_for_bit(tmp_path: Path,
                                                                   arch: str) -> None:
    stock_losses, stock = _train(_build(arch), None)
    losses, ours = _train(_build(arch), _plugin(tmp_path))
    assert losses == stock_losses
    for name, value in stock.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)


def test_bf16_overlapped_step_streams_the_copy_the_update_wrote(tmp_path: Path) -> None:
    """With bf16 compute the update writes each layer's bf16 copy: the run equals the
    serial one (which casts each master on the training thread) bit for bit."""
    serial = _train(_build("llama"), _plugin(tmp_path, overlap_step=False),
                    mixed_precision="bf16")
    overlapped = _train(_build("llama"), _plugin(tmp_path), mixed_precision="bf16")
    assert overlapped[0] == serial[0]
    for name, value in serial[1].items():
        torch.testing.assert_close(overlapped[1][name], value, rtol=0, atol=0, msg=name)


class _Recorder:
    """Order of events: each layer's compute starting (its submodules' pre-hooks, past
    the engine's wait) and each group's update ending (slowed by `delay_s`)."""

    def __init__(self, acc: Accelerator, model: nn.Module, delay_s: float) -> None:
        self.events: list[tuple[str, int]] = []
        engine = acc.lazytrain.engine
        self._layer_of = {id(p): j for j in range(1, len(engine._layers) + 1)
                          for p in engine.layer_params(j)}
        for j, layer in enumerate(engine._layers, start=1):  # its own modules run: computing
            for child in layer.children():
                child.register_forward_pre_hook(lambda *_, j=j: self.events.append(("fwd", j)))
        inner = acc.lazytrain.optimizer
        original = inner.step_params

        def slow_step_params(params: Any, **kwargs: Any) -> None:
            time.sleep(delay_s)
            original(params, **kwargs)
            assert threading.current_thread().name == "lazytrain-step"
            self.events.append(("upd", self._layer_of.get(id(params[0]), 0)))

        inner.step_params = slow_step_params


def test_layer_1_forward_starts_before_the_last_layers_update_ends(tmp_path: Path) -> None:
    model = _build("qwen2", num_layers=6)
    acc = Accelerator(cpu=True, plugin=_plugin(tmp_path))
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     _loader())
    batch = next(iter(loader))
    acc.backward(model(**batch).loss)
    recorder = _Recorder(acc, model, delay_s=0.05)
    opt.step()  # returns at once: the update runs on its thread, slowly
    opt.zero_grad()  # deferred per layer
    recorder.events.append(("step_returned", 0))
    model(**batch).loss.backward()
    events = recorder.events
    assert events.index(("step_returned", 0)) < events.index(("upd", 6))
    # Layer j's forward waits for layer j's update only: it starts before layers j+1..
    # are updated (the last one, 6, ends well after layer 1's forward began).
    assert events.index(("fwd", 1)) < events.index(("upd", 6))
    for j in range(1, 7):
        assert events.index(("upd", j)) < events.index(("fwd", j)), j
    assert acc.lazytrain.engine.stats().optimizer_wait_s > 0
    acc.end_training()


def test_checkpoints_and_state_dicts_wait_for_a_running_update(tmp_path: Path) -> None:
    model = _build("llama")
    acc = Accelerator(cpu=True, plugin=_plugin(tmp_path))
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     _loader())
    batch = next(iter(loader))
    acc.backward(model(**batch).loss)
    _Recorder(acc, model, delay_s=0.02)  # 5 groups: the update takes >= 0.1 s
    opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # waits for it
    acc.wait_for_everyone()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    acc.backward(model(**batch).loss)
    opt.step()
    state = opt.state_dict()  # the optimizer's state waits too: every tensor at step 2
    assert state["state"] and all(int(s["step"]) == 2 for s in state["state"].values())
    acc.backward(model(**batch).loss)
    opt.step()
    acc.save_state(str(tmp_path / "ckpt"))  # a checkpoint holds the whole update
    assert not acc.lazytrain.engine.steps.update_pending
    acc.end_training()
