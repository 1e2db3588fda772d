"""The sentence of a refusal: each binding tier, its shortfall, its base, and the largest
term of that base with the option that shrinks it.

Options are named as the CLI flag and the `LazyTrainConfig` field, both of which exist for
every option named here (`plan`, `simulate` and `max-batch` share them); the batch size,
which `max-batch` searches rather than takes, is left to the callers that have it
(`infeasible.with_largest_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping

from lazytrain_accel.planning.host import host_remedy
from lazytrain_accel.planning.problem import (
    DEVICE_RESIDENT_TERM,
    GIB,
    PlanInfeasibleError,
    Problem,
)
from lazytrain_accel.profiling.working_set import (
    ATTENTION_TERM,
    BOUNDARY_TERM,
    HEAD_WORKING_TERM,
    LAYER_WORKING_TERM,
    TILED_BOUNDARY_TERM,
    TOKEN_WISE_TERM,
)

_BUDGET_FLAG = {"gpu": "--gpu-memory-gb (gpu_memory_limit_gb)",
                "cpu": "--cpu-memory-gb (cpu_memory_limit_gb)",
                "nvme": "--nvme-gb (nvme_limit_gb)"}

#: What shrinks each named term of the GPU base (`Problem.gpu_base_terms`).
_TERM_REMEDY = {
    HEAD_WORKING_TERM: "the fused chunked loss shrinks it: "
    "--loss-chunk-tokens auto (loss_chunk_tokens='auto') or a chunk such as 4096",
    LAYER_WORKING_TERM: "it grows with batch x sequence: a shorter "
    "--seq-len or a smaller micro-batch shrinks it",
    ATTENTION_TERM: "K, V and their gradients of the whole sequence stay on the device even "
    "with the layer in sequence tiles, so it grows with batch x sequence: a shorter "
    "--seq-len or a smaller micro-batch shrinks it",
    TOKEN_WISE_TERM: "the planner tiles it (Plan.tile_tokens) when the untiled one does not "
    "fit; what is left is one tile's: a shorter --seq-len shrinks the rest",
    BOUNDARY_TERM: "the layer's output and input gradients, its mid residual and its norms' "
    "outputs are [batch x sequence, hidden] each: a shorter --seq-len or a smaller "
    "micro-batch shrinks them",
    TILED_BOUNDARY_TERM: "even with the whole layer in sequence tiles its output gradient "
    "is [batch x sequence, hidden]: a shorter --seq-len or a smaller micro-batch shrinks it",
    "3 layer weight buffers": "--max-recompute-block 1 (max_recompute_block=1) keeps 2",
    DEVICE_RESIDENT_TERM: "--resident-update host (resident_update='host') keeps them on "
    "the host with the layers'",
}


def readable_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps three significant digits visible."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _largest_term(p: Problem, tier: str) -> str:
    if tier == "gpu" and p.gpu_base_terms:
        name, nbytes = p.gpu_base_terms[0]
        remedy = _TERM_REMEDY.get(name, "it does not depend on the plan")
        return f"; its largest term is {name} ({readable_bytes(nbytes)}): {remedy}"
    if tier == "cpu" and p.cpu_base_terms:
        name, nbytes = p.cpu_base_terms[0]
        return f"; its largest term is {name} ({readable_bytes(nbytes)}): {host_remedy(name)}"
    return ""


def _split_layout(p: Problem, tier: str) -> str:
    """Over several nodes holding the whole state each, the host's other way out."""
    if tier != "cpu" or p.nodes == 1 or p.node_layout == "split":
        return ""
    return (f"; split the state over the {p.nodes} nodes (--node-layout split): each keeps "
            f"1/{p.nodes} of the masters, moments and gradients")


def infeasible_error(p: Problem, strategy: str,
                     shortfall_bytes: Mapping[str, int]) -> PlanInfeasibleError:
    """The error naming each binding tier, its shortfall, its base and the way out."""
    parts = []
    for tier, short in shortfall_bytes.items():
        budget, base = p.budget_bytes(tier), p.fixed_bytes(tier)
        parts.append(f"{tier.upper()} short by {readable_bytes(short)} (needs "
                     f"{readable_bytes(budget + short)}, budget {readable_bytes(budget)}, base "
                     f"{readable_bytes(base)} before activations{_largest_term(p, tier)}"
                     f"{_split_layout(p, tier)})")
    flags = " / ".join(_BUDGET_FLAG[tier] for tier in shortfall_bytes) or "the budgets"
    detail = "; ".join(parts) or "no tier named (solver limit reached while diagnosing)"
    return PlanInfeasibleError(
        f"no {strategy} plan fits {p.num_layers} layers with "
        f"{readable_bytes(p.boundary_bytes)} per boundary: {detail}. Raise {flags}, shorten "
        "--seq-len, or pick a strategy that recomputes or offloads more.",
        dict(shortfall_bytes))
