"""Sequence-tiled token-wise blocks (`engine/sequence/tiles.py`): found generically, and the
gradients equal the untiled run's up to fp32 summation order, in every family."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from engine_helpers import ARCH_CONFIGS, batches, build_model, make_plan, twin
from torch.utils._python_dispatch import TorchDispatchMode

from lazytrain_accel.distributed import ranks
from lazytrain_accel.engine import attach, find_decoder_layers
from lazytrain_accel.engine.sequence.tiles import find_token_mlp

CPU = torch.device("cpu")
TILE = 5  # 2 x 16 tokens: 7 tiles, the last one short
#: Dropout inside the MLP draws per tile, not as one tensor: off where the test compares
#: with the untiled run (`test_dropout_in_the_mlp_replays_per_tile` covers it).
#: Every family but OPT, whose fc1 / fc2 sit on the layer itself (it runs untiled).
TILED_ARCHS = sorted(a for a in ARCH_CONFIGS if a != "opt")
NO_MLP_DROPOUT = {"gpt2": {"resid_pdrop": 0.0}, "gpt_bigcode": {"resid_pdrop": 0.0}}


def _tiled_twin(ref: torch.nn.Module, kind: str, tmp_path, tile_tokens: int = TILE):
    model = twin(ref)
    num_layers = len(find_decoder_layers(model)[2])
    plan = dataclasses.replace(make_plan(kind, num_layers), tile_tokens=tile_tokens,
                               tiling="mlp" if tile_tokens else "none")
    return model, attach(model, plan, device=CPU, nvme_dir=str(tmp_path))


def _assert_grads_equal(ref: torch.nn.Module, model: torch.nn.Module) -> None:
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_the_token_wise_block_is_found_without_family_names(arch):
    layer = find_decoder_layers(build_model(arch, 1))[2][0]
    found = find_token_mlp(layer)
    names = {m: n for n, m in layer.named_children()}
    if arch not in TILED_ARCHS:
        assert found is None
    else:
        assert names[found] == "mlp"


@pytest.mark.parametrize("kind", ["checkpoint_all", "megatrain"])
@pytest.mark.parametrize("arch", TILED_ARCHS)
def test_tiled_gradients_equal_untiled(arch, kind, tmp_path):
    ref = build_model(arch, 4, **NO_MLP_DROPOUT.get(arch, {}))
    model, engine = _tiled_twin(ref, kind, tmp_path)
    mlp = find_token_mlp(find_decoder_layers(model)[2][0])
    inner = next(m for m in mlp.modules() if list(m.parameters(recurse=False)))
    calls = []
    inner.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = batches(1)[0]
    torch.manual_seed(7)  # dropout outside the MLP draws the same in both
    out_ref = ref(input_ids=ids, labels=ids, use_cache=False)
    out_ref.loss.backward()
    torch.manual_seed(7)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(ref, model)
    tiles = -(-ids.numel() // TILE)
    assert len(calls) >= 3 * tiles and len(calls) % tiles == 0  # forward, re-run, backward
    engine.detach()
    assert all("forward" not in m.__dict__ for m in model.modules()
               if m not in find_decoder_layers(model)[2])  # no patch left on an MLP


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_alone_reaches_the_tiles(arch, tmp_path):
    ref = build_model(arch, 4)
    model, engine = _tiled_twin(ref, "megatrain", tmp_path)
    ids = batches(1)[0]
    outs = [m(input_ids=ids, labels=ids) for m in (ref, model)]
    for out in outs:
        assert [tuple(t.shape) for t in out.router_logits] == [(32, 8)] * 4
        assert all(t.requires_grad for t in out.router_logits)
        out.aux_loss.backward()  # only the routers' gradient
    torch.testing.assert_close(outs[1].aux_loss, outs[0].aux_loss, rtol=1e-6, atol=0)
    _assert_grads_equal(ref, model)
    engine.detach()


def _tile_by_hand(mlp: torch.nn.Module, tile_tokens: int) -> None:
    """Plain autograd over the same tiles, in the same order: the reference for dropout."""
    own = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        parts = [own(flat[a:a + tile_tokens].unsqueeze(0))
                 for a in range(0, flat.shape[0], tile_tokens)]
        return torch.cat(parts, dim=1).reshape(x.shape)

    mlp.forward = forward


@pytest.mark.parametrize("kind", ["checkpoint_all", "megatrain"])
def test_dropout_in_the_mlp_replays_per_tile(kind, tmp_path):
    ref = build_model("gpt2", 4)  # dropout 0.1 inside the MLP, in attention and embeddings
    model, engine = _tiled_twin(ref, kind, tmp_path)
    for layer in find_decoder_layers(ref)[2]:
        _tile_by_hand(layer.mlp, TILE)
    ids = batches(1)[0]
    torch.manual_seed(3)
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    torch.manual_seed(3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(ref, model)
    engine.detach()


class _LargestIntermediate(TorchDispatchMode):
    """The most tokens of any [..., tokens, intermediate] tensor an op returns (the down
    projection's [hidden, intermediate] weight and its gradient aside)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.weight_shape, self.most = (hidden, intermediate), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 \
                    and t.shape[-1] == self.weight_shape[1] and t.shape != self.weight_shape:
                self.most = max(self.most, t.numel() // t.shape[-1])
        return out


@pytest.mark.parametrize("tile_tokens,most_tokens", [(0, 48), (8, 8)])
def test_only_one_tile_of_the_intermediate_exists(tile_tokens, most_tokens, tmp_path):
    ref = build_model("llama", 2, intermediate_size=112)
    model, engine = _tiled_twin(ref, "checkpoint_all", tmp_path, tile_tokens=tile_tokens)
    ids = batches(1, seq=24)[0]
    with _LargestIntermediate(32, 112) as seen:
        model(input_ids=ids, labels=ids).loss.backward()
    assert seen.most == most_tokens
    engine.detach()


def test_a_family_without_a_token_wise_block_runs_untiled_and_says_so(tmp_path, caplog):
    ref = build_model("opt", 2)
    model, engine = _tiled_twin(ref, "checkpoint_all", tmp_path)
    ids = batches(1)[0]
    with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
    said = [r for r in caplog.records if "runs untiled" in r.getMessage()
            or "run untiled" in r.getMessage()]
    assert len(said) == 1 and "OPTDecoderLayer" in said[0].getMessage()
    engine.detach()


def test_ranks_that_tile_differently_disagree_on_the_plan() -> None:
    """The launch's rank check (`distributed/ranks.py:rank_key`) covers the plan's tiling:
    MLP tiles and whole-layer tiles of one size are different plans."""
    model = build_model("llama", 2)
    plan = make_plan("megatrain", 2)
    keys = {ranks.rank_key(dataclasses.replace(plan, tiling=tiling, tile_tokens=tokens),
                           model, {})["plan"]
            for tiling, tokens in (("none", 0), ("mlp", 8), ("layer", 8), ("layer", 16))}
    assert len(keys) == 4
