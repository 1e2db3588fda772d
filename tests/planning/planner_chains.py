"""Synthetic layer chains for the planner tests: profiles built directly, no torch.

`random_chain` draws the rates and sizes every random chain of the tests and of
`bench/planner.py` uses, from hypothesis (`instances`, the property test) or from a
seeded `random.Random` (`tight_chains`, the bench's and the solve-speed test's class).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from lazytrain_accel.planning import Budgets, build_problem
from lazytrain_accel.planning.problem import Problem
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelGeometry, ModelProfile

GIB = 2**30
FLOPS_PER_S = 1e12


def chain(*, num_layers: int, batch_size: int = 4, boundary_gib: float = 1.0,
          layer_param_gib: float = 0.5, fwd_s: float = 0.05, bwd_s: float = 0.1,
          h2d_gbps: float = 12.0, d2h_gbps: float = 12.0, nvme_read_gbps: float = 3.0,
          nvme_write_gbps: float = 3.0) -> tuple[ModelProfile, HardwareProfile]:
    layer_params = int(layer_param_gib * GIB / 2)
    geometry = ModelGeometry(
        name=f"chain{num_layers}", family="synthetic", num_layers=num_layers,
        hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_kv_heads=8,
        head_dim=128, vocab_size=1000, tied_embeddings=True,
        layer_param_count=layer_params, embedding_param_count=1_000_000,
        head_param_count=0, final_norm_param_count=1024)
    model = ModelProfile(
        geometry=geometry, batch_size=batch_size, seq_len=256, compute_bytes_per_elem=2,
        boundary_bytes=int(boundary_gib * GIB * batch_size / 4),
        layer_param_bytes=2 * layer_params, layer_grad_bytes=2 * layer_params,
        layer_working_bytes=int(0.25 * GIB), layer_fwd_flops=fwd_s * FLOPS_PER_S,
        layer_bwd_flops=bwd_s * FLOPS_PER_S, head_fwd_flops=0.01 * FLOPS_PER_S,
        resident_param_bytes=2_000_000)
    hardware = HardwareProfile(
        name="synthetic", gpu_name="synthetic", gpu_memory_bytes=80 * GIB,
        cpu_memory_bytes=512 * GIB, nvme_bytes=1024 * GIB, peak_bf16_flops_per_s=2e12,
        achieved_flops_per_s=FLOPS_PER_S, h2d_bytes_per_s=h2d_gbps * 1e9,
        d2h_bytes_per_s=d2h_gbps * 1e9, nvme_read_bytes_per_s=nvme_read_gbps * 1e9,
        nvme_write_bytes_per_s=nvme_write_gbps * 1e9, cpu_optimizer_params_per_s=1e9,
        source="synthetic test chain")
    return model, hardware


def budgets_in_slots(model: ModelProfile, hardware: HardwareProfile, *, gpu_slots: int,
                     cpu_slots: int, nvme_slots: int, max_recompute_block: int = 8) -> Budgets:
    """Budgets leaving room for exactly that many boundaries in each tier (GPU slots are
    what remains after the static bytes, staging and reserve)."""
    p = build_problem(model, hardware, max_recompute_block=max_recompute_block,
                      budgets=Budgets(gpu_bytes=0, cpu_bytes=0, nvme_bytes=0))
    A = model.boundary_bytes
    fixed = p.gpu_fixed_bytes + A * gpu_slots  # reserve is 0 at a zero budget
    gpu = math.ceil(fixed / (1 - 0.04)) + 1
    while gpu - int(0.04 * gpu) < fixed:
        gpu += 1
    return Budgets(gpu_bytes=gpu, cpu_bytes=p.cpu_fixed_bytes + A * cpu_slots,
                   nvme_bytes=A * nvme_slots)


#: What a random chain draws each of `chain`'s knobs from.
CHAIN_CHOICES: dict[str, tuple[float, ...]] = {
    "boundary_gib": (0.25, 1.0), "layer_param_gib": (0.1, 0.5, 1.5),
    "fwd_s": (0.02, 0.05, 0.2), "bwd_s": (0.04, 0.1, 0.4),
    "h2d_gbps": (4.0, 12.0, 40.0), "d2h_gbps": (4.0, 12.0, 40.0),
    "nvme_read_gbps": (1.0, 3.0), "nvme_write_gbps": (1.0, 3.0)}


def random_chain(pick: Callable[[Sequence[Any]], Any], *, num_layers: int,
                 boundary_gib: float | None = None) -> tuple[ModelProfile, HardwareProfile]:
    """A chain whose knobs `pick` chooses from `CHAIN_CHOICES` (a hypothesis draw or a
    seeded `random.Random().choice`); `boundary_gib`, when given, is not drawn."""
    knobs = {k: pick(v) for k, v in CHAIN_CHOICES.items()
             if not (k == "boundary_gib" and boundary_gib is not None)}
    if boundary_gib is not None:
        knobs["boundary_gib"] = boundary_gib
    return chain(num_layers=num_layers, **knobs)


def _draw_from(draw: st.DrawFn) -> Callable[[Sequence[Any]], Any]:
    return lambda options: draw(st.sampled_from(options))


@st.composite
def instances(draw: st.DrawFn, *, max_layers: int = 6) -> tuple:
    """(model, hardware, budgets, K): random small chains, from roomy to tight."""
    L = draw(st.integers(2, max_layers))
    K = draw(st.integers(1, 4))
    model, hardware = random_chain(_draw_from(draw), num_layers=L, boundary_gib=1.0)
    budgets = budgets_in_slots(model, hardware, gpu_slots=draw(st.integers(3, L + 2)),
                               cpu_slots=draw(st.integers(0, L)),
                               nvme_slots=draw(st.integers(0, 2)), max_recompute_block=K)
    return model, hardware, budgets, K


@st.composite
def property_chains(draw: st.DrawFn, deep_layers: tuple[int, ...] = (48, 64, 96)) -> tuple:
    """(model, hardware, budgets, K) of the property test: mostly 4-14 layers, about one
    in 40 deep; budgets from generous to just-feasible, NVMe on or off."""
    deep = draw(st.integers(0, 39)) == 0
    L = draw(st.sampled_from(deep_layers)) if deep else draw(st.integers(4, 14))
    K = draw(st.sampled_from([1, 2, 3, 4, 8]))
    model, hardware = random_chain(_draw_from(draw), num_layers=L)
    nvme = draw(st.booleans())
    budgets = budgets_in_slots(
        model, hardware, gpu_slots=draw(st.integers(2, L + 2)),
        cpu_slots=draw(st.integers(0, L)),
        nvme_slots=draw(st.integers(1, L)) if nvme else 0, max_recompute_block=K)
    return model, hardware, budgets, K


def tight_chains(count: int, seed: int = 15, num_layers: int = 64) -> list[Problem]:
    """Deep chains of the property test's tight class, seeded: few GPU slots (4-14), a
    host and NVMe that hold part of the rest, random rates (K = 8)."""
    rng, problems = random.Random(seed), []
    for _ in range(count):
        model, hw = random_chain(rng.choice, num_layers=num_layers)
        budgets = budgets_in_slots(model, hw, gpu_slots=rng.randint(4, 14),
                                   cpu_slots=rng.randint(16, 48),
                                   nvme_slots=rng.randint(0, 24))
        problems.append(build_problem(model, hw, budgets=budgets))
    return problems
