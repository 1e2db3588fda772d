"""The weight pool loads what the simulator and the planner count, plan by plan: a
recompute block's last layer stays loaded through its re-runs (three slots), and the last
re-run layers are not loaded again for their backward."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, build_model, make_plan

from lazytrain_accel.engine import attach
from lazytrain_accel.planning.problem import build_problem
from lazytrain_accel.planning.simulate import _StepBuilder
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import geometry_from_config, profile_model

CPU = torch.device("cpu")


@pytest.mark.parametrize(("kind", "layers"), [("checkpoint_all", 6), ("megatrain", 10),
                                              ("mixed", 10), ("offload_all", 6)])
def test_engine_loads_equal_the_simulated_and_planned_loads(kind, layers, tmp_path):
    model = build_model("qwen2", layers)
    plan = make_plan(kind, layers)
    engine = attach(model, plan, device=CPU, nvme_dir=str(tmp_path))
    recomputes = any(e - s >= 2 for s, e in plan.blocks)
    assert engine.pool.num_slots == (3 if recomputes else 2)
    layer_bytes = 4 * sum(p.numel() for p in engine.layer_params(1))
    ids = batches(1)[0]
    for _ in range(2):  # the second step loads as the first (a new pass forgets the pool)
        engine.reset_stats()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        loads = engine.stats().transfer_bytes["weights_h2d"] / layer_bytes
    profile = profile_model(geometry_from_config(model.config.to_dict()), batch_size=2,
                            seq_len=16, compute_bytes_per_elem=4)
    longest = max(e - s for s, e in plan.blocks)
    p = build_problem(profile, HARDWARE_PRESETS["h800"],
                      max_recompute_block=longest)
    ops = _StepBuilder(p, plan).build().ops
    simulated = [op.name for op in ops if op.resource == "h2d" and op.name[0] in "RW"]
    assert loads == len(simulated)
    edges = dict.fromkeys(plan.blocks, 1)
    planned = 1 + sum(p.mandatory_bytes(edges)["h2d"]) / p.layer_param_bytes  # 1: prologue
    assert loads == planned
    assert engine.stats().peak_bytes["device"] >= engine.pool.num_slots * layer_bytes
