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
