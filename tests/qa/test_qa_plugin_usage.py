"""What users do around the training loop: the hybrid 8-bit operator with decay groups and
clipping under accumulation, evaluation in the middle, generate() after training,
save_pretrained through get_state_dict, LoRA-style freezing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from qa_helpers import build, decay_groups, padded_samples, plugin, train

from lazytrain_accel import Accelerator
from lazytrain_accel.optim import HybridAdamW8bit


def _reference_hybrid(arch: str, *, accumulation: int = 2, max_norm: float = 0.5):
    """Plain model, HybridAdamW8bit with its own fused clipping: what the plugin must do."""
    model = build(arch)
    optimizer = HybridAdamW8bit(decay_groups(model), lr=1e-2, max_grad_norm=max_norm)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    loader = torch.utils.data.DataLoader(padded_samples(), batch_size=2)
    losses, norms = [], []
    torch.manual_seed(5)
    for i, batch in enumerate(loader):
        loss = model(**batch).loss
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            norms.append(float(optimizer.grad_norm()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses, norms, dict(model.named_parameters()), optimizer


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_hybrid8bit_with_decay_groups_and_accumulated_clipping(tmp_path: Path,
                                                               arch: str) -> None:
    losses, norms, params, reference = _reference_hybrid(arch)
    ours = train(build(arch), plugin(tmp_path, "offload_all"))
    assert ours.losses == losses
    assert ours.grad_norms == pytest.approx(norms, rel=1e-6)  # engine sums squares per layer
    for name, value in params.items():
        torch.testing.assert_close(ours.params[name], value.detach(), rtol=1e-6, atol=1e-7,
                                   msg=name)
    assert [g["weight_decay"] for g in reference.param_groups] == [0.1, 0.0]


def test_eval_midway_generate_and_save_pretrained(tmp_path: Path) -> None:
    """Eval under no_grad between steps changes nothing; generate() through the engine and a
    reload of the saved checkpoint in plain transformers agree with the trained weights."""
    runs = {}
    for name, lazy in (("stock", None), ("ours", plugin(tmp_path, "megatrain",
                                                        optimizer="keep"))):
        model = build("gpt2")
        acc = Accelerator(cpu=True, **({} if lazy is None else {"plugin": lazy}))
        model, opt, loader = acc.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2),
            torch.utils.data.DataLoader(padded_samples(), batch_size=2))
        losses, evals = [], []
        torch.manual_seed(7)
        for i, batch in enumerate(loader):
            model.train()
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if i == 1:
                model.eval()
                with torch.no_grad():
                    evals.append(model(**batch).loss.item())
        model.eval()
        prompt = padded_samples()[0]["input_ids"][None, :4]
        with torch.no_grad():
            tokens = acc.unwrap_model(model).generate(prompt, max_new_tokens=6,
                                                      do_sample=False, pad_token_id=0)
            logits = model(input_ids=prompt).logits
        acc.unwrap_model(model).save_pretrained(tmp_path / name,
                                                state_dict=acc.get_state_dict(model))
        runs[name] = (losses, evals, tokens, logits)
        acc.end_training()
    (losses, evals, tokens, _), (stock_losses, stock_evals, stock_tokens, _) = (
        runs["ours"], runs["stock"])
    assert losses == stock_losses and evals == stock_evals
    assert torch.equal(tokens, stock_tokens)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reloaded(input_ids=prompt).logits
    torch.testing.assert_close(logits, runs["ours"][3], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_frozen_embeddings_and_a_frozen_layer(tmp_path: Path, arch: str) -> None:
    def frozen() -> torch.nn.Module:
        model = build(arch)
        model.get_input_embeddings().requires_grad_(False)
        layer_one = [p for n, p in model.named_parameters() if ".layers.1." in n]
        assert layer_one
        for p in layer_one:
            p.requires_grad_(False)
        return model

    stock = train(frozen(), None)
    ours = train(frozen(), plugin(tmp_path, "megatrain", optimizer="keep"))
    assert ours.losses == stock.losses and ours.grad_norms == stock.grad_norms
    initial = dict(build(arch).named_parameters())
    for name, value in stock.params.items():
        torch.testing.assert_close(ours.params[name], value, rtol=0, atol=0, msg=name)
        if "embed_tokens" in name or ".layers.1." in name:
            assert torch.equal(ours.params[name], initial[name].detach()), name


def test_prepare_leaves_the_model_config_alone(tmp_path: Path) -> None:
    """The engine strips KV caches from training calls itself; prepare() must not switch
    `config.use_cache` off, or every checkpoint saved from the run generates without a
    cache once reloaded (and the user's config silently changed)."""
    runs = {}
    for name, lazy in (("stock", None), ("ours", plugin(tmp_path, "offload_all",
                                                        optimizer="keep"))):
        model = build("llama")
        model.config.use_cache = True
        runs[name] = train(model, lazy)
        assert model.config.use_cache is True, name
        model.save_pretrained(tmp_path / name)
    assert runs["ours"].losses == runs["stock"].losses
    for key, value in runs["stock"].params.items():
        torch.testing.assert_close(runs["ours"].params[key], value, rtol=0, atol=0, msg=key)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "ours").use_cache is True
