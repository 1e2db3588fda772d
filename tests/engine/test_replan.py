"""A batch beyond the plan asks the front end for a new plan before it runs."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from engine_helpers import batches, build_model, make_plan

from lazytrain_accel.engine import attach

CPU = torch.device("cpu")


def test_a_longer_batch_is_replanned_before_its_forward(tmp_path, caplog):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))
    asked = []

    def replan(batch: int, seq: int):
        asked.append((batch, seq))
        return dataclasses.replace(make_plan("offload_all", 4), seq_len=64)

    engine.replan = replan
    ids = batches(1, seq=16)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert asked == []  # 2 x 16 is the plan's shape
    long = batches(1, seq=40)[0]
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        model(input_ids=long, labels=long).loss.backward()
        model(input_ids=long, labels=long).loss.backward()
    assert asked == [(2, 40)] and engine.plan.seq_len == 64  # once: the new plan holds it
    ours = [r for r in caplog.records if r.name.startswith("lazytrain_accel")]
    assert engine.stats().layer_forwards > 0 and not ours
    with pytest.raises(ValueError, match=r"plan\.num_layers=10"):
        engine.set_plan(make_plan("mixed", 10))


def test_without_a_new_plan_the_cpu_warning_names_no_gpu(tmp_path, caplog):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))
    engine.replan = lambda batch, seq: None
    long = batches(1, seq=40)[0]
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        for _ in range(2):
            model(input_ids=long, labels=long).loss.backward()
    (record,) = [r for r in caplog.records if r.name.startswith("lazytrain_accel")]
    assert "2 x 40" in record.getMessage() and "GPU" not in record.getMessage()


def test_a_new_plan_brings_its_loss_head_where_the_engine_follows_the_plan(tmp_path):
    model = build_model("qwen2", 4)
    plan = dataclasses.replace(make_plan("megatrain", 4), loss_chunk_tokens=8)
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path), loss_chunk_tokens="auto")
    assert engine.fused_loss is not None and engine.fused_loss.chunk_tokens == 8
    engine.replan = lambda batch, seq: dataclasses.replace(plan, seq_len=64, loss_chunk_tokens=4)
    long = batches(1, seq=40)[0]
    out = model(input_ids=long, labels=long)  # re-planned at its first layer
    out.loss.backward()
    assert engine.fused_loss.chunk_tokens == 4 and out.logits is None  # fused: no logits
    engine.set_plan(dataclasses.replace(plan, loss_chunk_tokens=0))
    assert engine.fused_loss is None
    assert model(input_ids=long, labels=long).logits is not None  # the model's own loss
    engine.set_plan(plan)
    assert engine.fused_loss.chunk_tokens == 8


def test_a_fixed_loss_chunk_stays_through_a_new_plan(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path),
                    loss_chunk_tokens=8)
    engine.set_plan(dataclasses.replace(make_plan("offload_all", 4), loss_chunk_tokens=4))
    assert engine.fused_loss.chunk_tokens == 8
    with pytest.raises(ValueError, match="'auto'"):
        attach(build_model("qwen2", 4), make_plan("megatrain", 4), device=CPU,
               loss_chunk_tokens="fused")
