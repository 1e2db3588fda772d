"""The node model: N GPUs of one node share one host (docs/planner.md "Several GPUs on a
node" defines every symbol here).

The local ranks map one copy of the host state and each updates a disjoint share of the
layers on 1/N of the cores, so: the shared host bytes count once, each rank's own buffers
N times (`host.py`, `ranks=`); each GPU's link runs at `min(PCIe, (eta B_host - D) / (2 N))`
(`link_bytes_per_s`), D the updates' DRAM traffic averaged over the step,
`min(R U, P_u U / C)` (`host_update_bytes_per_s`), an upper bound whatever the plan; each
share updates at `R / N` (`share_update_params_per_s`). Ownership (`owner_of_groups`, also
the engine's split update): contiguous runs of groups in forward order, balanced by bytes.
Every rank runs the same per-rank plan; a node's tokens/s is N times a rank's. Across K
nodes (docs/planner.md "Several nodes"): each node holds the whole state ("replicated") or
1/K of all but the compute copy ("split", `state_shards`; which node updates each group:
`node_of_groups`); `network_bytes_per_step`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lazytrain_accel.planning.host import GRAD_BYTES_PER_PARAM
from lazytrain_accel.planning.plan import NODE_LAYOUTS
from lazytrain_accel.profiling.hardware import (
    HOST_MEMORY_EFFICIENCY,
    HOST_UPDATE_BYTES_PER_PARAM,
    HardwareProfile,
)

#: Owner of a group every rank updates (residents whose masters live on each GPU).
EVERY_RANK = -1
#: DMA streams per GPU that touch DRAM at once: its H2D (reads) and its D2H (writes).
STREAMS_PER_GPU = 2


def resolve_node_layout(layout: str, nodes: int) -> str:
    """`layout` ("auto" or one of `NODE_LAYOUTS`) for a launch of `nodes`: "auto" splits
    the state over several nodes; one node holds it all either way ("replicated")."""
    if layout not in ("auto", *NODE_LAYOUTS):
        raise ValueError(f"node_layout={layout!r} is not one of {('auto', *NODE_LAYOUTS)}")
    if nodes == 1:
        return "replicated"
    return "split" if layout == "auto" else layout


def state_shards(layout: str, nodes: int) -> int:
    """The parts a node's masters, moments and gradients are cut into (K split, else 1)."""
    return nodes if layout == "split" else 1


def network_bytes_per_step(*, host_update_params: int, every_rank_params: int,
                           copy_bytes_per_param: int, nodes: int, layout: str) -> int:
    """Bytes one node sends to the others each step, in ring collectives (each node sends
    (K-1)/K of a buffer per pass): the host-updated parameters' fp32 gradients all-reduced
    (replicated: 2 passes) or reduce-scattered, then their new compute copy all-gathered
    at `copy_bytes_per_param` (split: 1 pass each); `every_rank_params` (residents whose
    masters live on every GPU) all-reduced either way."""
    if nodes == 1:
        return 0
    share = (nodes - 1) / nodes
    every = 2 * share * GRAD_BYTES_PER_PARAM * every_rank_params
    if layout == "replicated":
        return int(2 * share * GRAD_BYTES_PER_PARAM * host_update_params + every)
    return int(share * (GRAD_BYTES_PER_PARAM + copy_bytes_per_param) * host_update_params
               + every)


def check_node_shape(*, gpus_per_node: int, nodes: int) -> None:
    """Raise `ValueError` naming the flag unless both counts are integers >= 1."""
    for flag, value in (("--gpus-per-node", gpus_per_node), ("--nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}={value!r} must be an integer >= 1")


def host_update_bytes_per_s(hardware: HardwareProfile, *, update_param_count: int,
                            compute_s: float) -> float:
    """The node's host updates' DRAM bytes a second, averaged over a step: the
    `update_param_count` (P_u, the node's host-updated parameters) x
    `HOST_UPDATE_BYTES_PER_PARAM` bytes each step moves, over the step's least length,
    max(`compute_s` (the compute-only step), P_u / R (the update's own seconds)). At most
    R U, reached when the update takes the whole step or longer."""
    update_s = update_param_count / hardware.cpu_optimizer_params_per_s
    step_s = max(compute_s, update_s)
    return update_param_count * HOST_UPDATE_BYTES_PER_PARAM / step_s if step_s > 0 else 0.0


def host_stream_bytes_per_s(hardware: HardwareProfile, gpus_per_node: int, *,
                            update_bytes_per_s: float) -> float:
    """One GPU's share of the host DRAM bandwidth for one of its DMA streams: what the
    N updates (`update_bytes_per_s`, `host_update_bytes_per_s`) leave of
    `HOST_MEMORY_EFFICIENCY` x the theoretical bandwidth, over `STREAMS_PER_GPU` x N
    streams."""
    usable = HOST_MEMORY_EFFICIENCY * hardware.host_memory_or_default()
    left = usable - update_bytes_per_s
    if left <= 0:
        raise ValueError(
            f"hardware profile {hardware.name!r}: the host update alone "
            f"({update_bytes_per_s / 1e9:.1f} GB/s averaged over the step at "
            f"cpu_optimizer_params_per_s={hardware.cpu_optimizer_params_per_s:.3g}) fills "
            f"the usable host memory bandwidth ({usable / 1e9:.1f} GB/s of "
            f"host_memory_bytes_per_s={hardware.host_memory_or_default():.3g}); correct "
            "host_memory_bytes_per_s in the profile")
    return left / (STREAMS_PER_GPU * gpus_per_node)


def link_bytes_per_s(pcie_bytes_per_s: float, hardware: HardwareProfile,
                     gpus_per_node: int, *, update_bytes_per_s: float) -> float:
    """A GPU's H2D or D2H rate on a node of `gpus_per_node`: its PCIe rate, or its share
    of the host memory bandwidth where that is less."""
    return min(pcie_bytes_per_s, host_stream_bytes_per_s(
        hardware, gpus_per_node, update_bytes_per_s=update_bytes_per_s))


def share_update_params_per_s(hardware: HardwareProfile, gpus_per_node: int) -> float:
    """One rank's host update rate: the node's rate over the N ranks' shares of cores."""
    return hardware.cpu_optimizer_params_per_s / gpus_per_node


def owner_of_groups(group_bytes: Sequence[int], ranks: int, *,
                    every_rank: Sequence[int] = ()) -> list[int]:
    """The local rank that owns (and updates) each parameter group, groups in forward
    order: contiguous runs balanced by bytes. Group g goes to rank
    floor(N x (bytes before g + half of g's) / total), so a rank owns whole groups, the
    shares differ by at most about one group, and each rank walks its run in forward
    order. Groups in `every_rank` (masters on every GPU) get `EVERY_RANK` and weigh
    nothing in the balance."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r} must be an integer >= 1 (the node's local ranks)")
    shared = [0 if g in every_rank else b for g, b in enumerate(group_bytes)]
    total, before, owners = sum(shared), 0, []
    for g, nbytes in enumerate(shared):
        if g in every_rank:
            owners.append(EVERY_RANK)
            continue
        middle = before + nbytes / 2
        owners.append(min(ranks - 1, int(ranks * middle / total)) if total else 0)
        before += nbytes
    return owners


def node_of_groups(group_bytes: Sequence[int], owners: Sequence[int], nodes: int
                   ) -> list[int]:
    """The node that updates each group in the split layout (`EVERY_RANK` for the groups
    every rank updates): each local rank's run of groups (`owners`, `owner_of_groups`) cut
    over the `nodes` by the same rule, so local rank l's share is split between the
    nodes' local ranks l, contiguous and balanced by bytes, each walked in forward order."""
    node_of = [EVERY_RANK] * len(owners)
    for rank in sorted(set(owners) - {EVERY_RANK}):
        run = [g for g, owner in enumerate(owners) if owner == rank]
        for g, node in zip(run, owner_of_groups([group_bytes[g] for g in run], nodes),
                           strict=True):
            node_of[g] = node
    return node_of
