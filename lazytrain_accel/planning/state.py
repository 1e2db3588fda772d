"""The host state's homes (`StateHomes`): what each choice costs in host DRAM, NVMe
capacity and NVMe traffic, and in which window each byte moves.

A decoder layer's host state has three parts (`plan.STATE_PARTS`), each in DRAM or in a
file on NVMe: `optimizer` (fp32 master and moments: read before its update, written
after it, in the update phase beside the next forward), `grads` (written in the backward
once the host has them, `grad_write_window`; read by the update) and `copies` (the
compute-dtype copy: written by the update, read before the backward's load,
`copy_read_window`; a recomputed layer keeps it in DRAM). The update phase streams each
group through `STATE_STAGING_GROUPS` DRAM buffers; the residents' state stays in DRAM.
Docs: docs/planner.md "Host state on NVMe".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lazytrain_accel.planning.host import (
    COMPUTE_COPY_TERM,
    GRAD_BYTES_PER_PARAM,
    GRAD_TERM,
    MASTER_BYTES_PER_PARAM,
    MASTER_TERM,
    OPTIMIZER_STATE_BYTES_PER_PARAM,
    OPTIMIZER_TERM,
    per_rank,
)
from lazytrain_accel.planning.plan import STATE_PARTS, StateHomes, backward_window

#: DRAM buffers of whole groups' state the update phase cycles through: one being read,
#: one being updated, one being written behind; the backward's copy reads and gradient
#: writes use the same buffers (they are never live at once with the update phase's).
STATE_STAGING_GROUPS = 3

STATE_STAGING_TERM = f"NVMe state buffers ({STATE_STAGING_GROUPS} layers' NVMe-homed parts)"
NVME_STATE_TERM = "host state homed on NVMe"


@dataclass(kw_only=True, frozen=True)
class StateSizes:
    """Bytes of one decoder layer's host state, per part (`plan.STATE_PARTS`)."""

    optimizer_bytes: int  # fp32 master + optimizer moments
    grads_bytes: int  # fp32 gradient
    copies_bytes: int  # compute-dtype copy (0 when the compute is fp32)
    master_bytes: int = 0  # of `optimizer_bytes`, the fp32 master

    def part_bytes(self, part: str) -> int:
        return getattr(self, f"{part}_bytes")

    @property
    def layer_bytes(self) -> int:
        return sum(self.part_bytes(part) for part in STATE_PARTS)

    def staging_bytes(self, parts: tuple[str, ...] = STATE_PARTS) -> int:
        """The DRAM the NVMe-homed `parts` stream through: `STATE_STAGING_GROUPS` layers'."""
        return STATE_STAGING_GROUPS * sum(self.part_bytes(part) for part in parts)


def state_sizes(*, update_param_count: int, optimizer: str, copy_bytes: int,
                shards: int = 1, master_shards: int = 1) -> StateSizes:
    """One layer's state parts on a node: `update_param_count` host-updated parameters
    under `optimizer`, and `copy_bytes` of compute-dtype copy; 1/`shards` of the gradient
    and moments (the split layout, `node.py`), 1/`master_shards` of the master
    (`host.master_shards`)."""
    o = OPTIMIZER_STATE_BYTES_PER_PARAM[optimizer]
    master = -(-MASTER_BYTES_PER_PARAM * update_param_count // master_shards)
    return StateSizes(
        optimizer_bytes=master + int(o * update_param_count / shards), master_bytes=master,
        grads_bytes=-(-GRAD_BYTES_PER_PARAM * update_param_count // shards),
        copies_bytes=copy_bytes)


#: Per part, per layer, the weight of "on NVMe": 1 for a fixed plan's homes (`weights_of`),
#: a binary variable in the MIP; the cost functions below take either.
StateWeights = Mapping[str, Mapping[int, Any]]


def weights_of(homes: StateHomes) -> dict[str, dict[int, int]]:
    """The weights of fixed homes."""
    return {part: dict.fromkeys(getattr(homes, part), 1) for part in STATE_PARTS}


def homed_parts(homes: StateHomes) -> tuple[str, ...]:
    """The parts some layer homes on NVMe (those the state buffers are charged for)."""
    return tuple(part for part in STATE_PARTS if getattr(homes, part))


def nvme_state_bytes(weights: StateWeights, sizes: StateSizes) -> Any:
    """NVMe bytes the homes take."""
    return sum(sizes.part_bytes(part) * q for part in STATE_PARTS
               for q in weights.get(part, {}).values())


def host_terms_with_state(terms: tuple[tuple[str, int], ...], weights: StateWeights,
                          sizes: StateSizes, *, staged: tuple[str, ...], ranks: int = 1,
                          shards: int = 1) -> tuple[tuple[str, Any], ...]:
    """The host base terms (`host.host_base_terms`, every part in DRAM) less the parts
    homed on NVMe, plus the buffers the `staged` parts stream through (none: unchanged),
    each of a node's `ranks` its own (each stages the layers it updates), whole layers
    where `sizes` are a node's 1/`shards` of each (the split layout updates each layer
    on one node)."""
    if not staged:
        return terms
    count = {part: sum(weights.get(part, {}).values()) for part in STATE_PARTS}
    moved = {MASTER_TERM: sizes.master_bytes * count["optimizer"],
             OPTIMIZER_TERM: (sizes.optimizer_bytes - sizes.master_bytes) * count["optimizer"],
             GRAD_TERM: sizes.grads_bytes * count["grads"],
             COMPUTE_COPY_TERM: sizes.copies_bytes * count["copies"]}
    out = []
    for name, nbytes in terms:
        for term, less in moved.items():
            if name.startswith(term):
                nbytes = nbytes - less
        out.append((name, nbytes))
    return (*out, (per_rank(STATE_STAGING_TERM, ranks),
                   ranks * shards * sizes.staging_bytes(staged)))


def grad_write_window(layer: int, num_layers: int, *, folds: bool) -> int | None:
    """The window in which layer `layer`'s gradient is written to NVMe, None when that
    would be after the backward (then it stays in DRAM: its update reads it next).

    The gradient leaves the device in B_{j-1}'s window; the host has it whole in the window
    after (B_{j-2}), or where the host folds it (`Problem.fold_in`: B_{j-3}) in the one
    after that (B_{j-4})."""
    window = backward_window(layer, num_layers) + (4 if folds else 2)
    return window if window < 2 * num_layers else None


def copy_read_window(layer: int, num_layers: int) -> int | None:
    """The window in which layer `layer`'s compute copy is read from NVMe: the one before
    the window that loads it for its backward (B_{j+1}'s, which prefetches layer j); None
    for the last layer, whose backward reuses its forward's weights."""
    return backward_window(layer, num_layers) - 2 if layer < num_layers else None


def allowed_layers(part: str, num_layers: int, *, folds: bool, copies_bytes: int
                   ) -> tuple[int, ...]:
    """The layers whose `part` may be homed on NVMe. Copies and masters only where the
    compute dtype is below fp32 (`copies_bytes`): in fp32 the device streams the masters
    themselves, which must then be in DRAM."""
    layers = range(1, num_layers + 1)
    if part == "grads":
        return tuple(j for j in layers
                     if grad_write_window(j, num_layers, folds=folds) is not None)
    return tuple(layers) if copies_bytes else ()


def backward_state_bytes(weights: StateWeights, sizes: StateSizes, num_layers: int, *,
                         folds: bool) -> dict[str, list[Any]]:
    """Per NVMe link, the bytes the homes move in each window of the step (the update
    phase's traffic is after the step: `simulate.py`)."""
    W = 2 * num_layers
    out: dict[str, list[Any]] = {"nvme_read": [0] * W, "nvme_write": [0] * W}
    for j, q in weights.get("grads", {}).items():
        w = grad_write_window(j, num_layers, folds=folds)
        if w is None:
            raise ValueError(f"layer {j}'s gradient has no window to be written in; keep it "
                             "in DRAM (`allowed_layers`)")
        out["nvme_write"][w] = out["nvme_write"][w] + sizes.grads_bytes * q
    for j, q in weights.get("copies", {}).items():
        w = copy_read_window(j, num_layers)
        if w is not None:
            out["nvme_read"][w] = out["nvme_read"][w] + sizes.copies_bytes * q
    return out


def update_io_bytes(weights: StateWeights, sizes: StateSizes, layer: int) -> tuple[Any, Any]:
    """(read, written) NVMe bytes of layer `layer`'s update: its master and moments, and
    its gradient, read before; its master and moments, and its compute copy, written
    after."""
    def q(part: str) -> Any:
        return weights.get(part, {}).get(layer, 0)

    read = sizes.optimizer_bytes * q("optimizer") + sizes.grads_bytes * q("grads")
    written = sizes.optimizer_bytes * q("optimizer") + sizes.copies_bytes * q("copies")
    return read, written


def update_phase_bytes(homes: StateHomes, sizes: StateSizes, num_layers: int
                       ) -> tuple[int, int]:
    """(read, written) NVMe bytes of the update phase: every layer's `update_io_bytes`."""
    weights = weights_of(homes)
    read = written = 0
    for j in range(1, num_layers + 1):
        r, w = update_io_bytes(weights, sizes, j)
        read, written = read + r, written + w
    return read, written


def step_nvme_state_bytes(homes: StateHomes, sizes: StateSizes, num_layers: int
                          ) -> tuple[int, int]:
    """(read, written) NVMe bytes of the state per step: the update phase's and the
    backward's."""
    read, written = update_phase_bytes(homes, sizes, num_layers)
    read += sizes.copies_bytes * sum(1 for j in homes.copies if j < num_layers)
    written += sizes.grads_bytes * len(homes.grads)
    return read, written
