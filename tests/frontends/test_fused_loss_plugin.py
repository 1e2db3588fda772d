"""The Accelerate plugin with `loss_chunk_tokens` trains exactly as the stock loop."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # a masked prompt
        out.append((ids, labels))
    return out


def _loader() -> torch.utils.data.DataLoader:
    ids = torch.cat([ids for ids, _ in _batches()])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def _train(model: torch.nn.Module, step, batches) -> list[float]:
    losses = []
    for ids, labels in batches:
        losses.append(step(model(input_ids=ids, labels=labels)))
    return losses


def test_plugin_with_fused_loss_reproduces_stock_losses_step_for_step(tmp_path) -> None:
    stock = _model()
    stock_opt = torch.optim.AdamW(stock.parameters(), lr=1e-2)

    def stock_step(out) -> float:
        out.loss.backward()
        stock_opt.step()
        stock_opt.zero_grad()
        return float(out.loss.detach())

    expected = _train(stock, stock_step, _batches())

    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", optimizer="keep",
                             loss_chunk_tokens=5, cache_dir=str(tmp_path / "cache"),
                             nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model = _model()
    model, opt, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                _loader())
    assert acc.lazytrain.engine.fused_loss.chunk_tokens == 5
    # The plan was sized for one chunk of logits, not the full tokens x vocab.
    profile = acc.lazytrain.run.model_profile
    assert profile.head_working_bytes < 48 * 64 * (4 + 4 + 4)

    def step(out) -> float:
        assert out.logits is None
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad()
        return float(out.loss.detach())

    got = _train(model, step, _batches())
    assert got == pytest.approx(expected, rel=1e-5)
    acc.end_training()
    assert "forward" not in model.__dict__  # detached: the model's own loss again


def test_env_variable_turns_it_on_and_bf16_autocast_passes_none_logits(tmp_path,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_LOSS_CHUNK_TOKENS", "7")
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    assert plugin.loss_chunk_tokens == 7
    acc = Accelerator(cpu=True, mixed_precision="bf16", plugin=plugin)
    model = _model()
    reference = _model()
    model, _opt, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()), _loader())
    ids, labels = _batches()[0]
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(input_ids=ids, labels=labels).loss
    assert float(out.loss) == pytest.approx(float(expected), rel=2e-2)
    acc.backward(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())
    acc.end_training()
