"""Sequence-tiled layers (`engine/sequence/layer_tiles.py`): the whole decoder layer runs in
tiles of `attention_block_tokens` positions, its attention as the tile's queries against the key
prefix. Gradients equal stock transformers' (one whole-sequence SDPA call) in families of
different layouts (llama, qwen2, gemma's scaled embeddings, phi3's fused projections, an
MoE); no kernel sees more than a tile's queries; the input gradient overwrites the output
gradient in place; a layer that cannot run in tiles runs whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import batches, build_model, make_plan, twin

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.sequence import layer_tiles
from lazytrain_accel.engine.sequence.long_sequence import LongSequenceError
from lazytrain_accel.engine.sequence.query_blocks import BLOCKED_IMPLEMENTATION
from lazytrain_accel.planning.tiles import tile_candidates
from lazytrain_accel.profiling.working_set import (
    LayerWorkingSet,
    boundary_bytes_per_token,
    key_pass_flops,
    key_side_bytes_per_token,
    layer_working_set,
    query_side_bytes_per_token,
    runs_in_tiles,
    token_wise_bytes_per_token,
)
from lazytrain_accel.run.setup import profile_for_run

CPU = torch.device("cpu")
BLOCK = 5  # 16 positions: tiles of 5, 5, 5, 1


def _sdpa_model(arch: str, **overrides: object) -> torch.nn.Module:
    model = build_model(arch, 3, **overrides)
    model.config._attn_implementation = BLOCKED_IMPLEMENTATION
    return model


def _spy(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[int, int]], list[bool]]:
    """(queries, keys) of every tile attention call; `reuse_grad` of every tiled backward."""
    calls: list[tuple[int, int]] = []
    reuses: list[bool] = []
    attention, backward = layer_tiles.block_attention, layer_tiles.backward

    def attend(q: torch.Tensor, k: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append((q.shape[2], k.shape[2]))
        return attention(q, k, *args)

    def back(*args: object, **kwargs: object) -> object:
        reuses.append(bool(kwargs["reuse_grad"]))
        return backward(*args, **kwargs)

    monkeypatch.setattr(layer_tiles, "block_attention", attend)
    monkeypatch.setattr(layer_tiles, "backward", back)
    return calls, reuses


def _run(ref: torch.nn.Module, model: torch.nn.Module, kwargs: dict, tmp_path) -> object:
    plan = dataclasses.replace(make_plan("megatrain", 3), tiling="layer", tile_tokens=BLOCK)
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    ref(**kwargs, use_cache=False).loss.backward()
    return engine


def _assert_grads_equal(ref: torch.nn.Module, model: torch.nn.Module) -> None:
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        if p_ref.grad is None:
            assert p.grad is None, name
            continue
        # k_proj's bias has an exactly-zero gradient (softmax ignores a per-query shift):
        # both runs leave rounding noise there, hence the absolute tolerance
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("arch", "padded"), [
    ("llama", False), ("llama", True), ("qwen2", False), ("gemma", False), ("phi3", False)])
def test_gradients_equal_stock_whole_sequence_attention(arch, padded, tmp_path, monkeypatch):
    ref = _sdpa_model(arch)
    model = twin(ref)
    ids = batches(1)[0]
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # a left-padded second sequence: a 4-D mask, its rows cut per tile
    kwargs = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    engine = _run(ref, model, kwargs, tmp_path)
    calls, reuses = _spy(monkeypatch)
    model(**kwargs).loss.backward()
    _assert_grads_equal(ref, model)
    assert calls and max(q for q, _ in calls) <= BLOCK  # every call saw one tile's queries
    assert {k for _, k in calls} == {5, 10, 15, 16}  # ... against the key prefix
    assert reuses == [True] * 3  # each backward wrote its dx over its dOut
    engine.detach()


def test_an_moe_layer_runs_in_tiles_and_falls_back_whole_when_it_records_router_logits(
        tmp_path, monkeypatch, caplog) -> None:
    ids = batches(1)[0]
    kwargs = {"input_ids": ids, "labels": ids}
    for record in (False, True):
        ref = _sdpa_model("mixtral", output_router_logits=record)
        model = twin(ref)
        engine = _run(ref, model, kwargs, tmp_path / str(record))
        calls, reuses = _spy(monkeypatch)
        with caplog.at_level("INFO", logger="lazytrain_accel"):
            model(**kwargs).loss.backward()
        _assert_grads_equal(ref, model)
        if record:  # the router logits reach transformers' collector: the layers run whole
            assert not reuses and "cannot run in sequence tiles" in caplog.text
        else:
            assert reuses == [True] * 3 and calls
        engine.detach()
        monkeypatch.undo()


@pytest.mark.parametrize("record", [False, True])
def test_the_planner_sizes_a_layer_that_runs_whole_as_untiled_and_the_engine_agrees(
        record, tmp_path, monkeypatch) -> None:
    """Mixtral recording its router logits runs its layers whole (`whole_layers.py`, from the
    config): every query-blocked candidate the planner weighs has the untiled working set
    (q, o, dO, dQ, norms and residual of the whole sequence, attention in query blocks, the
    MLP in its tiles) and no key pass; without router logits, the sequence-tiled one. The
    engine, attached with such a plan, runs the layers as the planner sized them: whole
    without ever trying tiles, or in tiles."""
    ref = _sdpa_model("mixtral", output_router_logits=record)
    model = twin(ref)
    batch, seq = 2, 4096  # planned at a length the planner's tiles (1K and up) divide
    profile = profile_for_run(model, batch_size=batch, seq_len=seq, compute_dtype=None)
    g = profile.geometry
    assert bool(g.whole_layer_reason) == record and runs_in_tiles(g) == (not record)
    assert ("router logits" in g.whole_layer_reason) == record
    blocked = [c for c in tile_candidates(profile) if c.attention_block_tokens]
    assert blocked
    for c in blocked:
        tile, block = c.tile_tokens, c.attention_block_tokens
        tokens, elem = batch * seq, 4
        untiled = LayerWorkingSet(
            attention_bytes=tokens * (4 * g.num_attention_heads * g.head_dim * elem
                                      + key_side_bytes_per_token(g, elem, blocked=True))
            + batch * block * query_side_bytes_per_token(g, elem),
            token_wise_bytes=min(tile, tokens) * token_wise_bytes_per_token(g, elem),
            boundary_bytes=tokens * boundary_bytes_per_token(g, elem),
            weight_grad_bytes=g.layer_param_count * elem)
        tiled = layer_working_set(dataclasses.replace(g, whole_layer_reason=""),
                                  batch_size=batch, seq_len=seq, bytes_per_elem=elem,
                                  weights=None, tile_tokens=tile, attention_block_tokens=block)
        assert tiled.sequence_tiled and tiled.total_bytes < untiled.total_bytes
        want = untiled if record else tiled
        assert c.layer_working_bytes == want.total_bytes
        assert c.layer_working_terms == want.terms()
        assert (key_pass_flops(g, batch_size=batch, seq_len=seq, attention_block_tokens=block)
                == 0) == record
    tries: list[int] = []
    forward = layer_tiles.forward

    def counted(*args: object, **kwargs: object) -> object:
        tries.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(layer_tiles, "forward", counted)
    ids = batches(1)[0]
    engine = _run(ref, model, {"input_ids": ids, "labels": ids}, tmp_path)
    model(input_ids=ids, labels=ids).loss.backward()
    _assert_grads_equal(ref, model)
    assert engine.runtime._layer_tiles_ok == [runs_in_tiles(g)] * 3
    assert (not tries) == record  # whole from the config: tiles never tried, never refused
    engine.detach()


@pytest.mark.parametrize("mask_elems", [layer_tiles.MASK_ELEMS, 7])
def test_one_layer_forward_and_backward_equal_autograd(mask_elems, monkeypatch) -> None:
    """`layer_tiles.forward` / `backward` on one qwen2 layer, batch 2, 23 positions in tiles
    of 4 (and, with a 7-element mask budget, each tile's queries in row blocks of one):
    output, input gradient (written over the output gradient) and weight gradients equal
    the layer's own autograd."""
    monkeypatch.setattr(layer_tiles, "MASK_ELEMS", mask_elems)
    model = _sdpa_model("qwen2")
    layer = model.model.layers[0]
    torch.manual_seed(1)
    hidden = torch.randn(2, 23, 32)
    positions = torch.arange(23).expand(2, -1)
    kwargs = {"position_embeddings": model.model.rotary_emb(hidden, positions),
              "attention_mask": None, "position_ids": positions}
    x = hidden.clone().requires_grad_()
    want = layer(x, **kwargs)
    grad = torch.randn_like(want)
    params = list(layer.parameters())
    want_grads = torch.autograd.grad(want, [x, *params], grad)
    configs = [layer.self_attn.config]
    out, replays = layer_tiles.forward(layer.forward, hidden, kwargs, block_tokens=4,
                                       configs=configs)
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
    dout = grad.clone()
    dx, got = layer_tiles.backward(layer.forward, hidden, kwargs, dout, params, block_tokens=4,
                                   configs=configs, replays=replays, hidden_grad=True,
                                   reuse_grad=True)
    assert dx is dout
    for g, w in zip([dx, *got], want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert configs[0]._attn_implementation == BLOCKED_IMPLEMENTATION  # restored


def test_k_and_v_of_2_31_elements_are_refused_before_any_kernel_runs() -> None:
    tiles = layer_tiles._Tiles(mode="forward", seq=2**21)
    tiles.begin(0, 4)
    key = torch.empty(1, 8, 4, 128, device="meta")  # 8 x 128 x 2^21 = 2^31 for the buffer
    with pytest.raises(LongSequenceError, match=r"K and V .*2\^31"):
        tiles.store(key, key)
    small = layer_tiles._Tiles(mode="forward", seq=2**21 - 1)
    small.begin(0, 4)
    small.store(key, key)


_CHUNKED = "lazytrain_test_chunked_prefill"
_prefix: list[list[torch.Tensor]] = []


def _chunked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       **kwargs):
    """The reference's attention: the tile's queries against every key so far, all with
    graph (a differentiable chunked prefill)."""
    keys, values = _prefix
    keys.append(key)
    values.append(value)
    k, v = torch.cat(keys, 2), torch.cat(values, 2)
    mask = None if attention_mask is None else attention_mask[..., :k.shape[2]]
    out = layer_tiles.block_attention(query, k, v, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _tiled_with_autograd(layer: torch.nn.Module) -> None:
    """Patch `layer` to run over tiles of `BLOCK` with plain autograd: the tiles draw
    dropout in the order the engine's forward does."""
    own = layer.forward

    def forward(hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seq = hidden.shape[1]
        leaves, spec, cuts = layer_tiles._cutters(kwargs, seq)
        _prefix[:] = [[], []]
        outs = [own(hidden[:, a:b], **layer_tiles._tile_kwargs(leaves, spec, cuts, a, b))
                for a, b in layer_tiles._bounds(seq, BLOCK)]
        return torch.cat(outs, 1)

    layer.forward = forward


def test_dropout_in_a_tile_draws_in_backward_what_its_forward_drew(tmp_path) -> None:
    """GPT-NeoX with hidden dropout 0.1: the engine's gradients equal plain autograd over
    the same tiles (a chunked prefill with graph), which draws each tile's dropout once;
    the engine's key pass and reverse pass must replay each tile's RNG to match."""
    from transformers import AttentionInterface

    AttentionInterface.register(_CHUNKED, _chunked_attention)
    ref = _sdpa_model("gpt_neox", hidden_dropout=0.1)
    model = twin(ref)
    ref.config._attn_implementation = _CHUNKED
    for layer in ref.gpt_neox.layers:
        _tiled_with_autograd(layer)
    ids = batches(1)[0]
    torch.manual_seed(5)
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    plan = dataclasses.replace(make_plan("megatrain", 3), tiling="layer", tile_tokens=BLOCK)
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    torch.manual_seed(5)
    model(input_ids=ids, labels=ids).loss.backward()
    _assert_grads_equal(ref, model)
    engine.detach()
