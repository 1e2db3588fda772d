"""Each pitfall of running HF layers through per-layer Functions, pinned by a test."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_helpers import assert_states_die_by_refcount, batches, build_model, make_plan, twin
from torch import nn

from lazytrain_accel.engine import (
    BoundaryModifiedError,
    UnsupportedModelError,
    attach,
    find_decoder_layers,
)

CPU = torch.device("cpu")


def _grads_match(ref: nn.Module, model: nn.Module, rtol: float = 1e-5, atol: float = 1e-6):
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        if p_ref.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=rtol, atol=atol, msg=name)


def _one_step(ref, model, loss_fn=None, **call):
    ids = batches(1)[0]
    loss_fn = loss_fn or (lambda out: out.loss)
    torch.manual_seed(7)
    loss_ref = loss_fn(ref(input_ids=ids, labels=ids, use_cache=False, **call))
    loss_ref.backward()
    torch.manual_seed(7)
    loss = loss_fn(model(input_ids=ids, labels=ids, **call))
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    return loss


def test_dropout_is_replayed_and_the_rng_stream_is_undisturbed(tmp_path):
    ref = build_model("gpt2", 8, resid_pdrop=0.3, attn_pdrop=0.3, embd_pdrop=0.3)
    model = twin(ref)
    attach(model, make_plan("megatrain", 8), device=CPU, nvme_dir=str(tmp_path))
    _one_step(ref, model)
    _grads_match(ref, model)
    torch.manual_seed(7)
    ref(input_ids=batches(1)[0], use_cache=False).logits.sum().backward()
    after_ref = torch.rand(4)
    torch.manual_seed(7)
    model(input_ids=batches(1)[0]).logits.sum().backward()
    torch.testing.assert_close(torch.rand(4), after_ref, rtol=0, atol=0)


def test_autocast_is_re_entered_in_backward(tmp_path):
    ref = build_model("llama", 4)
    model = twin(ref)
    attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _one_step(ref, model)
    _grads_match(ref, model)


def test_frozen_embeddings_still_train_the_layers(tmp_path):
    ref = build_model("qwen2", 4)
    ref.get_input_embeddings().weight.requires_grad_(False)
    model = twin(ref)
    attach(model, make_plan("offload_all", 4), device=CPU, nvme_dir=str(tmp_path))
    _one_step(ref, model)
    _grads_match(ref, model)
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_outputs_used_beyond_the_next_layer_keep_their_gradients(tmp_path):
    ref = build_model("qwen2", 4)
    model = twin(ref)
    attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))

    def loss_fn(out):  # every layer's output feeds the loss directly
        return out.loss + sum(h.pow(2).mean() for h in out.hidden_states)

    _one_step(ref, model, loss_fn, output_hidden_states=True)
    _grads_match(ref, model)


def test_in_place_change_of_a_stored_boundary_is_detected(tmp_path):
    model = build_model("llama", 4)
    attach(model, make_plan("checkpoint_all", 4), device=CPU, nvme_dir=str(tmp_path))

    def corrupt(_module, args, _output):
        with torch.no_grad():
            args[0].add_(1.0)  # boundary 1, the input of layer 2, after layer 2 stored it

    model.model.layers[1].register_forward_hook(corrupt)
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(BoundaryModifiedError, match="boundary 1 was modified in place"):
        loss.backward()


@pytest.mark.parametrize("kind", ["checkpoint_all", "mixed"])
def test_opt_layerdrop_indexes_state_by_executed_position(kind, tmp_path):
    ref = build_model("opt", 10, layerdrop=0.5)
    model = twin(ref)
    engine = attach(model, make_plan(kind, 10), device=CPU, nvme_dir=str(tmp_path))
    _one_step(ref, model)
    _grads_match(ref, model)
    assert engine.stats().layer_forwards < 10  # layers were really skipped


def test_store_keeps_no_graph_alive(tmp_path):
    model = build_model("qwen2", 10)
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path))
    assert_states_die_by_refcount(model, engine)


def test_deepcopy_of_a_streamed_model_is_plain_and_self_contained(tmp_path):
    model = build_model("gpt2", 4)
    engine = attach(model, make_plan("offload_all", 4), device=CPU, nvme_dir=str(tmp_path))
    copy = twin(model)
    engine.reset_stats()
    ids = batches(1)[0]
    torch.manual_seed(0)
    copy_loss = copy(input_ids=ids, labels=ids).loss
    copy_loss.backward()
    assert engine.stats().layer_forwards == 0  # the copy never called into the engine
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, copy_loss, rtol=1e-5, atol=1e-6)


def test_generate_and_eval_run_through_the_engine_with_kv_cache(tmp_path):
    ref = build_model("llama", 4).eval()
    model = twin(ref)
    engine = attach(model, make_plan("offload_all", 4), device=CPU,
                    nvme_dir=str(tmp_path))
    ids = batches(1)[0][:, :6]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    engine.reset_stats()
    expected = ref.generate(ids, max_new_tokens=5, do_sample=False)
    got = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)
    # one pass over the prompt plus one per new token, each token reusing the cache
    assert engine.stats().layer_forwards == 4 * 5
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_models_without_a_decoder_stack_and_mismatched_plans_are_refused():
    with pytest.raises(UnsupportedModelError, match="no ModuleList of identical"):
        find_decoder_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = build_model("qwen2", 4)
    parent, name, layers = find_decoder_layers(model)
    assert parent is model.model and name == "layers" and len(layers) == 4
    with pytest.raises(ValueError, match=r"plan\.num_layers=10 but the model has 4"):
        attach(model, make_plan("mixed", 10), device=CPU)


def test_a_dropped_streamed_model_is_collected(tmp_path):
    import weakref

    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("offload_all", 4), device=CPU, nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    model_ref, engine_ref = weakref.ref(model), weakref.ref(engine)
    del model, engine
    gc.collect()
    assert model_ref() is None and engine_ref() is None
