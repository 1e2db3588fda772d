"""The host-memory model: every byte a run holds in host DRAM, term by term.

One list of terms serves the MIP's CPU capacity row (`Problem.host_terms`), the
simulator's static host bytes, the refusals (`refusal.py`) and `preflight.py`'s check
before the engine allocates: fp32 masters and gradient accumulators, the host optimizer's
state, frozen weights as stored, the layers' compute-dtype copies (an upper bound with
`overlap_step=False`), pinned staging, NVMe bounce buffers and DRAM-homed boundaries. On a
node of N local ranks (`node.py`) the shared terms count once, each rank's staging,
bounce buffers and boundaries N times.
Docs: docs/planner.md "The MIP" (`F_C`) and "Several GPUs on a node".
"""

from __future__ import annotations

from typing import Any

from lazytrain_accel.profiling.profile import ModelProfile

#: fp32 master and fp32 gradient accumulator of each host-updated parameter.
MASTER_BYTES_PER_PARAM = 4
GRAD_BYTES_PER_PARAM = 4

#: Host bytes of optimizer state per trainable parameter. Hybrid 8-bit: two 1-byte moments
#: plus one fp32 absmax per 256-value block of each. A kept optimizer is priced as AdamW
#: (two fp32 moments), the most common choice and an upper bound for SGD-like ones.
OPTIMIZER_STATE_BYTES_PER_PARAM: dict[str, float] = {"hybrid8bit": 2 + 2 * 4 / 256,
                                                     "keep": 8.0}
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_STATE_BYTES_PER_PARAM)

#: Pinned staging buffers used in turn for weights (H2D) and for gradients (D2H).
NUM_HOST_STAGING = 2

#: The gradient reduce between ranks (`distributed/grad_reduce.py`) sends each group in
#: pieces of at most this many elements (16 MiB of fp32), from where its gradients landed
#: (the pinned staging) or the owner's `.grad` in place: a rank's buffers are one piece
#: and, on the node updating a group of the split layout, one received from each node;
REDUCE_PIECE_NUMEL = 2**22
#: at most this many groups' sends are queued at once: one sent while the next lands
#: (in the gradient staging's other slot, or the backward's outputs on a CPU device).
MAX_REDUCES_IN_FLIGHT = 1

#: Term names (refusals and preflight look their remedies up by these).
MASTER_TERM = "the trainable parameters' fp32 masters"
GRAD_TERM = "the trainable parameters' fp32 gradients"
OPTIMIZER_TERM = "the optimizer state"
FROZEN_HOST_TERM = "the frozen weights as stored"
COMPUTE_COPY_TERM = "the layers' compute-dtype copies (overlapped update)"
WEIGHT_STAGING_TERM = "pinned staging for weights"
GRAD_STAGING_TERM = "pinned staging for 2 layers of gradients"
NVME_STAGING_TERM = "NVMe bounce buffers"
CPU_HOME_TERM = "boundaries homed in host DRAM"
GRAD_IN_FLIGHT_TERM = "gradients in flight between ranks"

#: What shrinks each term, as the CLI flag and the `LazyTrainConfig` field.
HOST_TERM_REMEDY: dict[str, str] = {
    MASTER_TERM: "training fewer parameters shrinks it: LoRA adapters on a frozen base "
    "(--lora-rank R) keep masters for the adapters only",
    GRAD_TERM: "training fewer parameters shrinks it: LoRA adapters (--lora-rank R)",
    OPTIMIZER_TERM: "optimizer='hybrid8bit' (LAZYTRAIN_OPTIMIZER) keeps about 2 bytes per "
    "parameter instead of a kept optimizer's 8 (priced as AdamW), or LoRA (--lora-rank R)",
    FROZEN_HOST_TERM: "a packed base shrinks it: --frozen-format nf4 (about 0.56 bytes per "
    "weight) or int8 (about 1), i.e. a bitsandbytes 4-bit/8-bit base (QLoRA)",
    COMPUTE_COPY_TERM: "2 bytes per layer weight at bf16/fp16 compute; the Accelerator's "
    "mixed_precision='no' (fp32 compute) writes none",
    NVME_STAGING_TERM: "a plan with no NVMe homes needs none: --nvme-gb 0 (nvme_limit_gb=0)",
    CPU_HOME_TERM: "--cpu-memory-gb (cpu_memory_limit_gb) lower makes the plan home fewer "
    "boundaries in DRAM (NVMe or recompute instead)",
    GRAD_IN_FLIGHT_TERM: "16 MiB pieces per rank (and one from each node, split): fewer "
    "ranks per node or nodes",
}


def check_optimizer(optimizer: str) -> None:
    """Raise `ValueError` unless the host model prices `optimizer`."""
    if optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAM:
        raise ValueError(f"optimizer={optimizer!r}: the host memory model prices one of "
                         f"{list(OPTIMIZERS)} (pass optimizer='keep' for any torch optimizer)")


def writes_compute_copies(model: ModelProfile, optimizer: str) -> bool:
    """Whether the hybrid update writes the layers' compute-dtype copies on the host."""
    return optimizer == "hybrid8bit" and model.compute_bytes_per_elem < 4


def master_shards(model: ModelProfile, optimizer: str, shards: int) -> int:
    """The parts a node's fp32 masters are cut into under a state cut `shards` ways: none
    where they are what the GPUs stream (no compute copy written: fp32 compute)."""
    return shards if writes_compute_copies(model, optimizer) else 1


def per_rank(name: str, ranks: int) -> str:
    """A per-rank term's name on a node of `ranks` (unchanged for one)."""
    return name if ranks == 1 else f"{name} (x {ranks} ranks)"


def host_base_terms(model: ModelProfile, *, optimizer: str = "hybrid8bit",
                    resident_update: str = "host", weight_slots: int = 2, ranks: int = 1,
                    shards: int = 1) -> tuple[tuple[str, int], ...]:
    """Host bytes that no home changes, term by term, largest first: the host-updated
    trainable parameters' masters, gradients and `optimizer` state (without the residents'
    when `resident_update="device"` moves them to the GPU), frozen weights as stored,
    compute copies (those once per node), and pinned weight and gradient staging
    (`weight_slots`: device weight buffers, each with a packed layer's staging beside it;
    those once per rank, `ranks` on the node). The node holds 1/`shards` of the
    gradients and optimizer state (the split layout over `shards` nodes, `node.py`), and
    of the layers' masters where they are not also the compute copy (fp32 compute streams
    them; the residents' masters, cast each pass, are on every node)."""
    check_optimizer(optimizer)
    w = model.weights
    host_trainable = model.trainable_param_count - (
        model.resident_trainable_param_count if resident_update == "device" else 0)
    packed_bytes = 0 if w is None else w.layer_packed_bytes
    packed_count = 0 if w is None else w.layer_packed_param_count
    float_layer_bytes = model.layer_param_bytes - packed_bytes
    weight_staging = NUM_HOST_STAGING * float_layer_bytes + weight_slots * packed_bytes
    cut = "" if shards == 1 else f" (1/{shards} per node)"
    masters_cut = master_shards(model, optimizer, shards)
    resident_masters = 0 if masters_cut == 1 or resident_update == "device" else \
        MASTER_BYTES_PER_PARAM * model.resident_trainable_param_count
    terms = [
        (MASTER_TERM + ("" if masters_cut == 1 else cut), resident_masters - (
            -(MASTER_BYTES_PER_PARAM * host_trainable - resident_masters) // masters_cut)),
        (GRAD_TERM + cut, -(-GRAD_BYTES_PER_PARAM * host_trainable // shards)),
        (f"{OPTIMIZER_TERM} ({optimizer}){cut}",
         int(OPTIMIZER_STATE_BYTES_PER_PARAM[optimizer] * host_trainable / shards)),
        (per_rank(WEIGHT_STAGING_TERM, ranks), ranks * weight_staging),
        (per_rank(GRAD_STAGING_TERM, ranks), ranks * NUM_HOST_STAGING * model.layer_grad_bytes),
    ]
    if in_flight := grads_in_flight_bytes(model, ranks=ranks, shards=shards):
        terms.append((per_rank(GRAD_IN_FLIGHT_TERM, ranks), in_flight))
    if w is not None:
        terms.append((f"{FROZEN_HOST_TERM} ({w.frozen_format})", model.frozen_host_bytes))
    if writes_compute_copies(model, optimizer):
        floats = model.geometry.layer_param_count - packed_count
        terms.append((COMPUTE_COPY_TERM,
                       model.num_layers * floats * model.compute_bytes_per_elem))
    return tuple(sorted(terms, key=lambda t: -t[1]))


def grads_in_flight_bytes(model: ModelProfile, *, ranks: int, shards: int) -> int:
    """A node's buffers of the gradient reduce between ranks (`ranks` local ranks, the
    state cut `shards` ways over the nodes): per rank, one piece and, split, one piece
    received from each node (`REDUCE_PIECE_NUMEL`). The gradients themselves are not
    copied: a rank that does not keep a layer sends them from the pinned staging they
    landed in (`GRAD_STAGING_TERM`), its owner reduces into its `.grad` in place
    (`GRAD_TERM`). Pieces no larger than a layer's trainable parameters."""
    if ranks == 1 and shards == 1:
        return 0
    piece = GRAD_BYTES_PER_PARAM * min(REDUCE_PIECE_NUMEL, model.layer_trainable_param_count)
    return ranks * piece * (1 + (shards if shards > 1 else 0))


def activation_host_terms(*, boundary_bytes: int, cpu_homes: Any, staging_boundaries: int,
                          nvme_staging: Any = 1, ranks: int = 1) -> tuple[tuple[str, Any], ...]:
    """The plan's host terms: `staging_boundaries` NVMe bounce buffers (times
    `nvme_staging`: 1 when the plan homes anything on NVMe, 0 when not; the MIP always
    charges them) and `cpu_homes` boundaries in DRAM, each once per rank of the node's
    `ranks` (every rank runs the plan). Counts or the MIP's expressions."""
    A = ranks * boundary_bytes
    return ((per_rank(NVME_STAGING_TERM, ranks), staging_boundaries * A * nvme_staging),
            (per_rank(CPU_HOME_TERM, ranks), A * cpu_homes))


def host_remedy(name: str) -> str:
    """What shrinks the term `name` (a `host_base_terms` or `activation_host_terms` name)."""
    for term, remedy in HOST_TERM_REMEDY.items():
        if name.startswith(term):
            return remedy
    return "it does not depend on the plan"
