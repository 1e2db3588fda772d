"""MoE layers stream exactly: router auxiliary loss on, multi-step, every plan kind.

Transformers 5 collects router logits with hooks inside each layer; the engine runs the
layer under no_grad, so without routing those tensors through the layer Function the aux
loss's gradient never reaches the layers (the loss matches at step 1 and drifts after).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    PLAN_KINDS,
    assert_states_die_by_refcount,
    batches,
    build_model,
    make_plan,
    twin,
)
from test_equivalence import train_pair

from lazytrain_accel.engine import attach

MOE = ("mixtral", "qwen3_moe")


def _expert_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for name, p in model.named_parameters()
            if "experts" in name and p.grad is not None]


@pytest.mark.parametrize("kind", PLAN_KINDS)
@pytest.mark.parametrize("arch", MOE)
def test_moe_with_aux_loss_matches_plain_pytorch_when_experts_get_no_tokens(arch, kind,
                                                                            tmp_path):
    # 3 tokens x top-2 of 8 experts: at least 2 experts per layer receive no token
    data = batches(3, batch=1, seq=3)
    losses_ref, losses, ref, model, engine = train_pair(arch, kind, tmp_path, data=data)
    assert losses == losses_ref
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=0, atol=0, msg=name)
    engine.detach()


@pytest.mark.parametrize("arch", MOE)
def test_router_logits_carry_the_aux_loss_gradient(arch, tmp_path):
    ref = build_model(arch, 4)
    model = twin(ref)
    attach(model, make_plan("megatrain", 4), device=torch.device("cpu"), nvme_dir=str(tmp_path))
    ids = batches(1, batch=1, seq=3)[0]
    for m in (ref, model):
        out = m(input_ids=ids, labels=ids)
        assert out.aux_loss is not None and len(out.router_logits) == 4
        assert all(t.requires_grad for t in out.router_logits)
        out.aux_loss.backward()  # the aux loss alone: every gradient comes from the routers
    per_expert = [g.flatten(1).abs().sum(1) for g in _expert_grads(ref)]
    assert any((row == 0).any() for row in per_expert), "an expert should have had no token"
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=0, msg=name)


def test_captured_attention_weights_carry_gradients(tmp_path):
    ref = build_model("qwen3_moe", 4)
    model = twin(ref)
    attach(model, make_plan("offload_all", 4), device=torch.device("cpu"),
           nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    for m in (ref, model):
        out = m(input_ids=ids, output_attentions=True, output_hidden_states=True)
        loss = sum(a.square().sum() for a in out.attentions) + out.hidden_states[2].sum()
        loss.backward()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_captured_tensors_keep_no_forward_state_alive(tmp_path):
    model = build_model("mixtral", 4)
    engine = attach(model, make_plan("megatrain", 4), device=torch.device("cpu"),
                    nvme_dir=str(tmp_path))
    assert_states_die_by_refcount(model, engine)
