"""The fused chunked cross-entropy equals HF's loss and every gradient, without the logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from lazytrain_accel.engine import (
    LogitsNotMaterializedError,
    UnsupportedModelError,
    apply_fused_loss,
    causal_lm_loss,
    fused_linear_cross_entropy,
)
from lazytrain_accel.engine.loss.fused_loss import LogitOp

TOL = dict(rtol=1e-5, atol=1e-6)
# Random unit-scale hidden states and weights: gradients of magnitude ~10 summed over the
# vocabulary in a different order differ by a few fp32 ulps.
WIDE = dict(rtol=1e-5, atol=1e-5)
SOFTCAP = (LogitOp(kind="div", value=3.0), LogitOp(kind="tanh"), LogitOp(kind="mul", value=3.0))


def _inputs(n: int = 37, h: int = 16, v: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::3] = -100
    return hidden, weight, bias, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 8, 24, 1000])  # 24 valid rows: 8 divides
@pytest.mark.parametrize("softcap", [False, True])
def test_function_matches_cross_entropy(reduction: str, chunk_tokens: int, softcap: bool
                                        ) -> None:
    hidden, weight, bias, targets = _inputs()
    logits = hidden @ weight.T + bias
    if softcap:
        logits = torch.tanh(logits / 3.0) * 3.0
    ref = F.cross_entropy(logits, targets, reduction=reduction)
    ours = fused_linear_cross_entropy(hidden, weight, targets, bias=bias,
                                      chunk_tokens=chunk_tokens, reduction=reduction,
                                      logit_ops=SOFTCAP if softcap else ())
    torch.testing.assert_close(ours, ref, **WIDE)
    for a, b in zip(torch.autograd.grad(ours * 0.7, (hidden, weight, bias)),
                    torch.autograd.grad(ref * 0.7, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(a, b, **WIDE)


def test_every_target_ignored_gives_nan_and_zero_grads_as_torch() -> None:
    hidden, weight, _, targets = _inputs()
    targets[:] = -100
    ours = fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=4)
    ref = F.cross_entropy(hidden @ weight.T, targets)
    assert torch.isnan(ours) and torch.isnan(ref)
    ours.backward()
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_bad_inputs_say_what_and_what_to_do() -> None:
    hidden, weight, _, targets = _inputs()
    targets[4] = 50
    with pytest.raises(ValueError, match="target 50 is outside the vocabulary"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=4)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="reduction='none'"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=4, reduction="none")
    with pytest.raises(ValueError, match="36 targets for 37 hidden rows"):
        fused_linear_cross_entropy(hidden, weight, targets[1:], chunk_tokens=4)


def test_retain_graph_backward_twice_and_no_grad() -> None:
    hidden, weight, _, targets = _inputs()
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=7)
    loss.backward(retain_graph=True)
    first = hidden.grad.clone()
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * first)
    with torch.no_grad():
        again = fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=7)
    torch.testing.assert_close(again, loss.detach())


def test_autocast_bf16_runs_the_matmul_in_bf16_like_hf() -> None:
    hidden, weight, _, targets = _inputs(n=64, h=32, v=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        ours = fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=16)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    g_ref = torch.autograd.grad(ref, (hidden, weight))
    g_ours = torch.autograd.grad(ours, (hidden, weight))
    for a, b in zip(g_ours, g_ref, strict=True):
        assert a.dtype == b.dtype == torch.float32  # grads reach the fp32 inputs
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_causal_lm_loss_is_hf_for_causal_lm_loss() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), generator=g)
    labels[1, :3] = -100
    for items in (None, torch.tensor(31)):
        ref = ForCausalLMLoss(hidden @ weight.T, labels, 40, num_items_in_batch=items)
        ours = causal_lm_loss(hidden, weight, labels, chunk_tokens=5, num_items_in_batch=items)
        torch.testing.assert_close(ours, ref, **TOL)
        for a, b in zip(torch.autograd.grad(ours, (hidden, weight)),
                        torch.autograd.grad(ref, (hidden, weight)), strict=True):
            torch.testing.assert_close(a, b, **TOL)


# ---- whole models -------------------------------------------------------------------
_SMALL = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)


def _model(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "gpt2":  # tied: the head weight is the token embedding
        config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight
        return model.train()
    config_class = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                    "gemma2": transformers.Gemma2Config, "cohere": transformers.CohereConfig}
    extra = {"gemma2": dict(final_logit_softcapping=2.0, head_dim=8),
             "cohere": dict(logit_scale=0.5)}.get(kind, {})
    config = config_class[kind](intermediate_size=64, num_hidden_layers=2,
                                num_key_value_heads=2, **_SMALL, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[1, -2:] = -100
    return ids, labels


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2", "gemma2", "cohere"])
@pytest.mark.parametrize("chunk_tokens", [4, 7])  # 14 valid rows after the shift: 7 divides
def test_model_loss_and_all_gradients_equal_hf(kind: str, chunk_tokens: int) -> None:
    model = _model(kind)
    reference = copy.deepcopy(model)
    handle = apply_fused_loss(model, chunk_tokens=chunk_tokens)
    ids, labels = _batch(1)
    torch.manual_seed(5)  # GPT-2 has dropout: the same masks in both runs
    out = model(input_ids=ids, labels=labels)
    torch.manual_seed(5)
    ref = reference(input_ids=ids, labels=labels)
    assert out.logits is None and ref.logits.shape == (2, 11, 96)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    handle.remove()
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def test_gradient_accumulation_with_num_items_in_batch() -> None:
    model, reference = _model("qwen2"), _model("qwen2")
    apply_fused_loss(model, chunk_tokens=5)
    batches = [_batch(1), _batch(2)]
    items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
    for ids, labels in batches:
        for m in (model, reference):
            m(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items)).loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_eval_no_labels_generate_and_tuples_are_unchanged() -> None:
    model = _model("qwen2")
    apply_fused_loss(model, chunk_tokens=4)
    ids, labels = _batch(1)
    assert model(input_ids=ids).logits.shape == (2, 11, 96)  # training, no labels
    loss, logits = model(input_ids=ids, labels=labels, return_dict=False)[:2]
    assert loss.ndim == 0 and logits is None
    model.eval()
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 11, 96)
    out = model.generate(ids[:1, :3], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
    copied = copy.deepcopy(model).train()  # a copy carries its own working fused loss
    assert copied(input_ids=ids, labels=labels).logits is None


def test_unsupported_use_of_the_logits_is_refused_clearly() -> None:
    model = _model("qwen2")
    apply_fused_loss(model, chunk_tokens=4)
    model.loss_function = lambda logits, labels, **_: logits.argmax(-1).float().mean()
    ids, labels = _batch(1)
    with pytest.raises(LogitsNotMaterializedError,
                       match=r"argmax on the logits.*loss_chunk_tokens=0"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match="already has the fused loss"):
        apply_fused_loss(model, chunk_tokens=4)
    with pytest.raises(UnsupportedModelError, match=r"not an nn\.Linear head"):
        apply_fused_loss(model.model, chunk_tokens=4)


class _LargestTensor(TorchDispatchMode):
    """Bytes of the largest tensor any op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, t.numel() * t.element_size())
        return out


def test_no_full_tokens_by_vocab_tensor_is_ever_created() -> None:
    config = transformers.Qwen2Config(vocab_size=32000, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 32000, (4, 128))
    full_logits_bytes = ids.numel() * 32000 * 4
    for fused in (False, True):
        handle = apply_fused_loss(model, chunk_tokens=64) if fused else None
        with _LargestTensor() as mode:
            model(input_ids=ids, labels=ids).loss.backward()
        if fused:
            # One chunk of fp32 logits, or the (vocab, hidden) head weight / its gradient.
            assert mode.largest_bytes <= max(64 * 32000 * 4, 32000 * 32 * 4)
            handle.remove()
        else:  # the measurement sees HF's full logits
            assert mode.largest_bytes >= full_logits_bytes


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_streaming_engine_with_fused_loss_equals_plain_training(arch: str) -> None:
    from engine_helpers import build_model, make_plan, twin

    from lazytrain_accel.engine import attach

    model = build_model(arch, 3)
    reference = twin(model)
    engine = attach(model, make_plan("offload_all", 3), device=torch.device("cpu"),
                    loss_chunk_tokens=6)
    ids, labels = _batch(4)
    torch.manual_seed(5)
    out = model(input_ids=ids, labels=labels)
    torch.manual_seed(5)
    ref = reference(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    out.loss.backward()
    ref.loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    engine.detach()
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 11, 96)
