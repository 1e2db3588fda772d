"""Attention in query blocks (`engine/sequence/query_blocks.py`): the blocked SDPA's gradients equal
one whole-sequence call's, through the engine in several families; no SDPA call sees more
queries than a block; plans it cannot run are refused at attach."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import batches, build_model, make_plan, twin

from lazytrain_accel.engine import attach, find_decoder_layers
from lazytrain_accel.engine.sequence.query_blocks import (
    BLOCKED_IMPLEMENTATION,
    QueryBlockError,
    _BlockedAttention,
)

CPU = torch.device("cpu")
BLOCK = 5  # 16 tokens: blocks of 5, 5, 5, 1


def _qkv(heads: int = 4, kv_heads: int = 2, seq: int = 23, dim: int = 8):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(2, h, seq, dim, generator=gen, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("masked", [False, True])
def test_blocked_gradients_equal_one_whole_call(masked: bool) -> None:
    q, k, v = _qkv()
    seq = q.shape[2]
    mask = None
    if masked:  # causal with the first 3 keys of the second sequence padded away
        mask = torch.ones(seq, seq, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
        mask[1, :, 3:, :3] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=True)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    out = _BlockedAttention.apply(BLOCK, None, mask, q, k, v)
    got = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _sdpa_query_lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def _sdpa_model(arch: str) -> torch.nn.Module:
    model = build_model(arch, 3)
    model.config._attn_implementation = BLOCKED_IMPLEMENTATION
    return model


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_engine_gradients_equal_whole_sequence_attention(arch, padded, tmp_path, monkeypatch):
    ref = _sdpa_model(arch)
    model = twin(ref)
    plan = dataclasses.replace(make_plan("megatrain", 3), tiling="layer", tile_tokens=BLOCK)
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # a left-padded second sequence: a 4-D mask, sliced per block
    kwargs = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    ref(**kwargs, use_cache=False).loss.backward()
    seen = _sdpa_query_lengths(monkeypatch)
    out = model(**kwargs)
    out.loss.backward()
    assert seen and max(seen) <= BLOCK  # every streamed call ran in blocks
    # layers x (forward, re-run, backward, and regenerated boundaries) x 4 blocks
    assert len(seen) >= 3 * 3 * 4 and len(seen) % 4 == 0
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    layer = find_decoder_layers(model)[2][0]
    assert layer.self_attn.config._attn_implementation == BLOCKED_IMPLEMENTATION
    engine.detach()


def test_a_plan_with_query_blocks_is_refused_for_eager_attention(tmp_path) -> None:
    model = build_model("llama", 2)  # eager
    plan = dataclasses.replace(make_plan("megatrain", 2), tiling="layer", tile_tokens=BLOCK)
    with pytest.raises(QueryBlockError, match=r"attn_implementation='sdpa'.*tiling 'none'"):
        attach(model, plan, device=CPU, nvme_dir=str(tmp_path))


def test_set_plan_refuses_query_blocks_it_cannot_run(tmp_path) -> None:
    model = build_model("llama", 2)
    engine = attach(model, make_plan("megatrain", 2), device=CPU, nvme_dir=str(tmp_path))
    blocked = dataclasses.replace(engine.plan, tiling="layer", tile_tokens=BLOCK)
    with pytest.raises(QueryBlockError, match="decoder layer 1"):
        engine.set_plan(blocked)
    assert engine.plan.tiling == "none"
    engine.detach()
