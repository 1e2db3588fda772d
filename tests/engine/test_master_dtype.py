"""One rule for the host masters' dtype (`engine/memory/weights.py:master_dtype`): the
engine casts the masters to it at attach, and the node store lays its segment out by it."""

from __future__ import annotations

import torch
from engine_helpers import build_model, make_plan

from lazytrain_accel.distributed import node_store
from lazytrain_accel.engine import attach
from lazytrain_accel.engine.memory.weights import master_dtype

CPU = torch.device("cpu")


def test_trainable_floats_get_fp32_masters_and_the_rest_stay_as_stored() -> None:
    trainable = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16), requires_grad=False)
    counts = torch.nn.Parameter(torch.zeros(2, dtype=torch.int8), requires_grad=False)
    assert master_dtype(trainable) == torch.float32
    assert master_dtype(frozen) == torch.bfloat16
    assert master_dtype(counts) == torch.int8


def test_the_engine_and_the_node_store_lay_out_the_same_masters(tmp_path) -> None:
    model = build_model("llama", 2).to(torch.bfloat16)
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen weight stays bf16
    params = node_store.shared_params(model)
    slots, _, _, _ = node_store._layout(params, len(params) + 2)
    engine = attach(model, make_plan("megatrain", 2), device=CPU, nvme_dir=str(tmp_path))
    after = dict(model.named_parameters())
    assert {after[name].dtype for name, _ in params} == {torch.float32, torch.bfloat16}
    for (name, _), slot in zip(params, slots, strict=True):
        assert slot.dtype == after[name].dtype == master_dtype(after[name]), name
    engine.detach()
