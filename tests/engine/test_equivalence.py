"""The engine computes what plain PyTorch computes: every family x every plan kind."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import ARCH_CONFIGS, PLAN_KINDS, batches, build_model, make_plan, twin

from lazytrain_accel.engine import attach

CPU = torch.device("cpu")


def _layers_for(kind: str) -> int:
    return 10 if kind == "mixed" else 4


def train_pair(arch: str, kind: str, tmp_path, *, accumulation: int = 1, steps: int = 3,
               compute_dtype: torch.dtype | None = None, data=None, **overrides):
    """Train a plain model and a streamed twin side by side; return losses and both models."""
    num_layers = _layers_for(kind)
    ref = build_model(arch, num_layers, **overrides)
    model = twin(ref)
    engine = attach(model, make_plan(kind, num_layers), device=CPU,
                    compute_dtype=compute_dtype, nvme_dir=str(tmp_path))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses_ref, losses = [], []
    data = data or batches(steps * accumulation)
    for step in range(steps):
        for micro in range(accumulation):
            ids = data[step * accumulation + micro]
            torch.manual_seed(100 * step + micro)  # same dropout masks for both
            loss_ref = ref(input_ids=ids, labels=ids, use_cache=False).loss / accumulation
            loss_ref.backward()
            torch.manual_seed(100 * step + micro)
            loss = model(input_ids=ids, labels=ids).loss / accumulation  # cache on: stripped
            loss.backward()
            losses_ref.append(loss_ref.item())
            losses.append(loss.item())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return losses_ref, losses, ref, model, engine


@pytest.mark.parametrize("kind", PLAN_KINDS)
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_training_matches_plain_pytorch(arch, kind, tmp_path):
    losses_ref, losses, ref, model, engine = train_pair(arch, kind, tmp_path)
    torch.testing.assert_close(losses, losses_ref, rtol=1e-5, atol=1e-6)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6, msg=name)
    state_ref, state = ref.state_dict(), model.state_dict()
    assert state.keys() == state_ref.keys()
    for key in state:
        torch.testing.assert_close(state[key], state_ref[key], rtol=1e-5, atol=1e-6)
    assert not list(tmp_path.rglob("*.bin")), "boundary files left behind after training"
    engine.detach()


@pytest.mark.parametrize("kind", ["checkpoint_all", "mixed"])
@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "opt"])
def test_gradient_accumulation_matches(arch, kind, tmp_path):
    losses_ref, losses, ref, model, _ = train_pair(arch, kind, tmp_path, accumulation=2)
    torch.testing.assert_close(losses, losses_ref, rtol=1e-5, atol=1e-6)
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_compute_stays_within_bf16_tolerance(arch, tmp_path):
    ref = build_model(arch, _layers_for("mixed"))
    model = twin(ref)
    attach(model, make_plan("mixed", 10), device=CPU, compute_dtype=torch.bfloat16,
           nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    torch.manual_seed(0)
    loss_ref = ref(input_ids=ids, labels=ids, use_cache=False).loss
    loss_ref.backward()
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    # The head ran in the compute dtype; transformers' ForCausalLMLoss upcasts its logits.
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, loss_ref, rtol=2e-2, atol=2e-2)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        error = (p.grad - p_ref.grad).norm() / p_ref.grad.norm().clamp_min(1e-6)
        assert error < 0.05, f"{name}: bf16 gradient off by {error:.3f} of the fp32 one"
