"""In-process checks of the Accelerate plugin's prepare / optimizer swap / clipping."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.optim import HybridAdamW8bit


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _loader() -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def _two_epochs(acc: Accelerator, model, opt, loader, clip_norm: float | None = None
                ) -> list[tuple[float, float | None]]:
    """(loss, clip norm or None) of each step of two epochs."""
    out = []
    for _ in range(2):
        for (ids,) in loader:
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            norm = None if clip_norm is None else float(acc.clip_grad_norm_(
                model.parameters(), clip_norm))
            opt.step()
            opt.zero_grad()
            out.append((float(loss.detach()), norm))
    return out


@pytest.fixture
def plugin(tmp_path) -> LazyTrainPlugin:
    return LazyTrainPlugin(plan="checkpoint_all", hardware="h800",
                           cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))


def test_optimizer_swap_keeps_groups_and_scheduler(plugin: LazyTrainPlugin) -> None:
    model = _model()
    user = torch.optim.AdamW([{"params": list(model.model.layers.parameters()), "lr": 1e-3},
                              {"params": list(model.lm_head.parameters()), "lr": 5e-4}],
                             weight_decay=0.02, betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.LambdaLR(user, lambda s: 0.5 ** s)
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, loader, scheduler = acc.prepare(model, user, _loader(), scheduler)
    inner = opt.optimizer
    assert isinstance(inner, HybridAdamW8bit)
    assert inner.param_groups is user.param_groups  # schedulers drive the same dicts
    assert [g["weight_decay"] for g in inner.param_groups] == [0.02, 0.02]
    assert inner.param_groups[0]["betas"] == (0.8, 0.9)
    (ids,) = next(iter(loader))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()"
        opt.step()
        scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert inner.param_groups[1]["lr"] == pytest.approx(2.5e-4)
    assert acc.unwrap_model(model) is model
    assert acc.prepare(model) is model  # a second prepare attaches nothing new
    acc.end_training()


def test_clip_grad_norm_routes_into_the_fused_update(plugin: LazyTrainPlugin) -> None:
    model = _model()
    reference = _model()
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters()), _loader())
    (ids,) = next(iter(loader))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    reference(input_ids=ids, labels=ids).loss.backward()
    grads_before = [p.grad.clone() for p in model.parameters()]
    norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)
    # The gradients are untouched: clipping happens once, inside the update.
    for before, p in zip(grads_before, model.parameters(), strict=True):
        assert torch.equal(before, p.grad)
    assert opt.optimizer.max_grad_norm == pytest.approx(1e-3)
    acc.end_training()


def test_foreign_plugins_are_refused(plugin: LazyTrainPlugin, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="cannot be combined with ACCELERATE_USE_FSDP"):
        Accelerator(cpu=True, plugin=plugin)


def test_without_plugin_it_is_the_stock_accelerator() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    assert acc.lazytrain is None
    assert type(opt.optimizer) is torch.optim.AdamW


def test_loading_optimizer_state_keeps_the_scheduler_in_charge(plugin: LazyTrainPlugin) -> None:
    model = _model()
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(user, lambda s: 0.5 ** s)
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, loader, scheduler = acc.prepare(model, user, _loader(), scheduler)
    (ids,) = next(iter(loader))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    scheduler.step()
    opt.optimizer.load_state_dict(opt.optimizer.state_dict())
    assert opt.optimizer.param_groups is user.param_groups
    scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    acc.end_training()


def test_bf16_mixed_precision_stays_within_bf16_tolerance(plugin: LazyTrainPlugin) -> None:
    losses = {}
    for name, kwargs in (("stock", {}), ("ours", {"plugin": plugin})):
        model = _model()
        acc = Accelerator(cpu=True, mixed_precision="bf16", **kwargs)
        model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                         _loader())
        losses[name] = [loss for loss, _ in _two_epochs(acc, model, opt, loader)]
        if acc.lazytrain is not None:
            # the streamed layer copies computed in bf16; the masters stayed fp32
            assert acc.lazytrain.engine.compute_dtype == torch.bfloat16
            assert all(p.dtype == torch.float32 for p in model.parameters())
        acc.end_training()
    assert losses["ours"] == pytest.approx(losses["stock"], rel=2e-2)


def test_fp16_loss_scaling_is_undone_before_the_clip_norm(plugin: LazyTrainPlugin) -> None:
    # A CUDA fp16 run scales the loss; on a CPU, Accelerate makes no scaler, so one is put
    # in by hand. The engine records the norms of the *scaled* gradients as they land:
    # clipping must use the unscaled norm, as stock does (it was `scale` times too large).
    runs = {}
    for name, kwargs in (("stock", {}), ("ours", {"plugin": plugin})):
        acc = Accelerator(cpu=True, mixed_precision="fp16", **kwargs)
        acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", init_scale=1024.0), True
        model = _model()
        model, opt, loader = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=3e-3),
                                         _loader())
        runs[name] = _two_epochs(acc, model, opt, loader, clip_norm=0.05)
        acc.end_training()
    (stock_losses, stock_norms), (losses, norms) = (zip(*runs[k], strict=True)
                                                    for k in ("stock", "ours"))
    assert norms == pytest.approx(stock_norms, rel=2e-2)
    assert losses == pytest.approx(stock_losses, rel=2e-3)
