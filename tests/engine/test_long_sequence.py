"""Attention at long sequence (`engine/sequence/long_sequence.py`): SDPA's flash CPU kernel with
`is_causal`, no S x S tensor; 4-D masks dropped when plain causal, else refused; eager
attention, padded 2-D masks and packed position ids refused before transformers builds an
S x S mask from them; attention dropout and int32 index overflow refused with what to do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from engine_helpers import ARCH_CONFIGS, make_plan
from torch.utils._python_dispatch import TorchDispatchMode

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.sequence.long_sequence import (
    LONG_SEQ_TOKENS,
    LongSequenceError,
    check_call,
)

SEQ = LONG_SEQ_TOKENS


def _model(attn: str = "sdpa", **overrides: object) -> torch.nn.Module:
    config = ARCH_CONFIGS["qwen2"](2)
    config.max_position_embeddings = SEQ
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _attached(model: torch.nn.Module, tmp_path) -> torch.nn.Module:
    plan = dataclasses.replace(make_plan("megatrain", 2), tiling="mlp", tile_tokens=1024)
    attach(model, plan, device=torch.device("cpu"), nvme_dir=str(tmp_path))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (1, SEQ), generator=torch.Generator().manual_seed(0))


class _Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.most, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.__name__)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_a_long_sequence_runs_flash_attention_and_builds_no_seq_by_seq_tensor(tmp_path):
    ref = _model()
    model = _attached(_model(), tmp_path)
    ids = _ids()
    with _Largest() as seen:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert "_scaled_dot_product_flash_attention_for_cpu.default" in seen.ops
    assert "_scaled_dot_product_flash_attention_for_cpu_backward.default" in seen.ops
    assert seen.most < SEQ * SEQ // 16  # one head's scores would be SEQ x SEQ
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_plain_causal_4d_mask_is_dropped_for_is_causal(tmp_path):
    model = _attached(_model(), tmp_path)
    ids = _ids()
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None]
    with_mask = model(input_ids=ids, labels=ids, attention_mask=mask).loss
    torch.testing.assert_close(with_mask, model(input_ids=ids, labels=ids).loss,
                               rtol=0, atol=0)


def test_a_padded_4d_mask_is_refused_with_what_to_do(tmp_path):
    model = _attached(_model(), tmp_path)
    ids = _ids()
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None].clone()
    mask[..., -1] = False  # the last token is padding
    with pytest.raises(LongSequenceError, match=r"not plain causal.*no attention_mask"):
        model(input_ids=ids, labels=ids, attention_mask=mask)


def test_eager_attention_is_refused_at_long_sequence_before_its_mask_is_built(tmp_path):
    model = _attached(_model(attn="eager"), tmp_path)
    with pytest.raises(LongSequenceError, match="attn_implementation='sdpa'"), \
            _Largest() as seen:
        model(input_ids=_ids(), labels=_ids())
    assert seen.most < SEQ * SEQ // 16


def test_a_padded_2d_mask_is_refused_before_the_model_builds_a_4d_one(tmp_path):
    model = _attached(_model(), tmp_path)
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[:, -7:] = 0  # right padding, as a collator gives
    with pytest.raises(LongSequenceError, match=r"padded 2-D attention mask.*padding_free"), \
            _Largest() as seen:
        model(input_ids=_ids(), labels=_ids(), attention_mask=mask)
    assert seen.most < SEQ * SEQ // 16


def test_packed_position_ids_are_refused_before_a_block_diagonal_mask_is_built(tmp_path):
    model = _attached(_model(), tmp_path)
    half = torch.arange(SEQ // 2)
    positions = torch.cat([half, half])[None]  # two samples packed in one row
    with pytest.raises(LongSequenceError, match=r"restart inside a row.*packing=False"), \
            _Largest() as seen:
        model(input_ids=_ids(), labels=_ids(), position_ids=positions)
    assert seen.most < SEQ * SEQ // 16


def test_attention_dropout_is_refused_not_run_on_the_math_kernel(tmp_path):
    model = _attached(_model(attention_dropout=0.1), tmp_path)
    with pytest.raises(LongSequenceError, match="attention dropout to 0"):
        model(input_ids=_ids(), labels=_ids())


def test_the_int32_index_limit_is_named_before_any_kernel_runs():
    hidden = torch.empty(1, 2**21, 1024, device="meta")  # 2^31 elements
    with pytest.raises(LongSequenceError, match=r"2\^31.*shorter sequences"):
        check_call(hidden, {}, attn_implementation="sdpa", verdicts={})
    check_call(torch.empty(1, 2**21, 1023, device="meta"), {}, attn_implementation="sdpa",
               verdicts={})
    # a layer run in sequence tiles: its kernels see one tile, the refusal is gone
    check_call(hidden, {}, attn_implementation="sdpa", verdicts={}, tiled=True)
