"""The loss head as a planning decision (`loss_chunk_tokens="auto"`).

HF's own loss keeps tokens x vocab logits (compute dtype, fp32 upcast, fp32 gradient) on
the device between the last forward and the first backward: at the paper's 27B batch of
72 x 1024 that is ~170 GiB, more than the GPU. The fused chunked loss keeps one chunk of
them. The planner plans with the chunk; when the chunked plan's homes also fit beside the
full logits, the full loss is kept (training outputs keep their logits at the same speed),
otherwise the plan turns the fused loss on and says so in `Plan.loss_chunk_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lazytrain_accel.planning.no_solver import evaluate_fixed
from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.problem import Budgets, build_problem
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model_configs import head_working_bytes, with_loss_chunk
from lazytrain_accel.profiling.profile import ModelProfile

#: Chunks the planner picks from, largest (fastest kernel) first.
CHUNK_CHOICES_TOKENS = (8192, 4096, 2048, 1024, 512, 256)


def auto_chunk_tokens(model: ModelProfile) -> int:
    """The largest chunk whose head working set stays under one layer's backward working
    set (so the head stops being the largest device term); 0 when the full logits do."""
    tokens, g = model.tokens_per_step, model.geometry
    full = head_working_bytes(g, tokens, model.compute_bytes_per_elem, 0)
    if full <= model.layer_working_bytes:
        return 0
    for chunk in CHUNK_CHOICES_TOKENS:
        if chunk < tokens and head_working_bytes(g, tokens, model.compute_bytes_per_elem,
                                                 chunk) <= model.layer_working_bytes:
            return chunk
    return CHUNK_CHOICES_TOKENS[-1] if CHUNK_CHOICES_TOKENS[-1] < tokens else 0


def plan_loss_head(model: ModelProfile, hardware: HardwareProfile,
                   plan_for: Callable[[ModelProfile], Plan], *, budgets: Budgets | None,
                   max_recompute_block: int, include_optimizer: bool) -> Plan:
    """`plan_for` at the chunked head; the same homes with the full logits when they fit."""
    full = with_loss_chunk(model, 0)
    chunk = auto_chunk_tokens(model)
    if chunk == 0:
        return plan_for(full)
    plan = plan_for(with_loss_chunk(model, chunk))
    p_full = build_problem(full, hardware, budgets=budgets,
                           max_recompute_block=max_recompute_block,
                           resident_update=plan.resident_update, optimizer=plan.optimizer,
                           gpus_per_node=plan.gpus_per_node, nodes=plan.nodes,
                           node_layout=plan.node_layout)
    if not evaluate_fixed(p_full, plan.homes).feasible:
        return plan
    kept = dataclasses.replace(plan, loss_chunk_tokens=0)
    prediction = simulate(kept, full, hardware,
                          include_optimizer=include_optimizer).prediction()
    b = p_full.budgets
    if (prediction.peak_gpu_bytes > b.gpu_bytes or prediction.peak_cpu_bytes > b.cpu_bytes):
        return plan
    return dataclasses.replace(kept, prediction=prediction)
