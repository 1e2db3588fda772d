"""Who owns what in a split update: the launch's nodes and each update group's owner.

`node_groups` places this rank among the launch's nodes x local ranks and builds the 2-D
process groups (`NodeGroups`: within the node, and across the nodes for this local rank,
with a second one for the split layout's broadcasts of new weights).
`share_owners` gives each update group (0: input residents, j: layer j, L+1: output
residents) its owning local rank by `planning/node.py:owner_of_groups` (the simulator's
rule too): contiguous runs in forward order balanced by trainable master bytes;
device-homed groups are every rank's (`EVERY_RANK`).
Design: docs/architecture.md "Several ranks on a node" ("Ownership").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from lazytrain_accel.engine.memory.weights import master_dtype
from lazytrain_accel.planning.node import EVERY_RANK, node_of_groups, owner_of_groups


@dataclass(frozen=True, kw_only=True)
class NodeGroups:
    """The launch as nodes x local ranks. `node_ranks[l]`: the global rank of this node's
    local rank l; `intra`: this node's process group, `cross`: this local rank's group
    across the nodes (None, the default group and no cross group, with one node).
    `cross_ranks[n]`: the global rank of this local rank on node n. `exchange`: a second
    group of the `cross` ranks for the split layout's broadcasts, issued by the update
    thread while the training thread's reduces use `cross` (None unless split)."""

    local_rank: int
    node: int
    nodes: int
    node_ranks: tuple[int, ...]
    cross_ranks: tuple[int, ...] = ()
    intra: dist.ProcessGroup | None = None
    cross: dist.ProcessGroup | None = None
    exchange: dist.ProcessGroup | None = None

    @property
    def local_size(self) -> int:
        return len(self.node_ranks)


def node_groups(*, local_rank: int, local_world_size: int, node_id: str,
                split: bool = False) -> NodeGroups:
    """This rank's place in the launch and its 2-D process groups (`split`: the exchange
    groups too). Nodes are told apart by `node_id` (`node_store.launch_identity`, the name
    the segment is keyed by), numbered in order of their lowest global rank; every node
    must hold local ranks 0..`local_world_size`-1. Every rank calls this (`new_group` is
    collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if local_world_size == world:  # one node: the default group, no second stage
        return NodeGroups(local_rank=rank, node=0, nodes=1, node_ranks=tuple(range(world)),
                          cross_ranks=(rank,))
    members = node_members(local_rank=local_rank, local_world_size=local_world_size,
                           node_id=node_id)
    nodes = list(members)  # insertion order: by lowest global rank
    intra = cross = exchange = None
    for node in nodes:  # every rank creates every group, in the same order
        group = dist.new_group(members[node])
        if node == node_id:
            intra = group
    for kind in ("cross", "exchange") if split else ("cross",):
        for local in range(local_world_size):
            group = dist.new_group([members[node][local] for node in nodes])
            if local == local_rank:
                cross, exchange = (group, exchange) if kind == "cross" else (cross, group)
    return NodeGroups(local_rank=local_rank, node=nodes.index(node_id), nodes=len(nodes),
                      node_ranks=tuple(members[node_id]),
                      cross_ranks=tuple(members[node][local_rank] for node in nodes),
                      intra=intra, cross=cross, exchange=exchange)


def node_members(*, local_rank: int, local_world_size: int, node_id: str
                 ) -> dict[str, list[int]]:
    """Each node's global ranks by local rank, the nodes in order of their lowest global
    rank (that order numbers them: `NodeGroups.node`). Collective on the default group."""
    world = dist.get_world_size()
    if world % local_world_size:
        raise ValueError(f"{world} processes do not split into nodes of LOCAL_WORLD_SIZE="
                         f"{local_world_size}")
    places: list[tuple[str, int] | None] = [None] * world
    dist.all_gather_object(places, (node_id, local_rank))
    members: dict[str, list[int | None]] = {}
    for r, (node, local) in enumerate(places):
        ranks = members.setdefault(node, [None] * local_world_size)
        if not 0 <= local < local_world_size or ranks[local] is not None:
            raise ValueError(f"rank {r} reports local rank {local} on node {node!r}, which "
                             f"is out of 0..{local_world_size - 1} or taken: the launcher's "
                             "LOCAL_RANK/LOCAL_WORLD_SIZE/node ranks disagree")
        ranks[local] = r
    for node, ranks in members.items():
        if None in ranks:
            held = [local for local, r in enumerate(ranks) if r is not None]
            raise ValueError(f"node {node!r} holds local ranks {held} of "
                             f"0..{local_world_size - 1}: every node must run "
                             "LOCAL_WORLD_SIZE ranks")
    return {node: [r for r in ranks if r is not None] for node, ranks in members.items()}


def split_groups(groups: Sequence[Sequence[nn.Parameter]], *, local_ranks: int, nodes: int,
                 every_rank: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """(owner, node) of each update group under the split layout over `nodes` nodes of
    `local_ranks` (`share_owners`, `node_of_groups`): local rank owner[g] of node node[g]
    updates group g (`EVERY_RANK` both for the groups every rank updates)."""
    owners = share_owners(groups, local_ranks, every_rank=every_rank)
    return owners, node_of_groups(group_master_bytes(groups), owners, nodes)


def layers_elsewhere(groups: Sequence[Sequence[nn.Parameter]], node_of: Sequence[int],
                     node: int) -> dict[int, list[nn.Parameter]]:
    """The decoder layers (groups 1..L) another node updates under the split layout, with
    their parameters: on node `node` they are held as their compute copy alone, received
    from that node (`node_store.share_model`'s `elsewhere`)."""
    return {g: list(groups[g]) for g in range(1, len(groups) - 1)
            if node_of[g] not in (node, EVERY_RANK) and groups[g]}


def share_owners(groups: Sequence[Sequence[nn.Parameter]], ranks: int, *,
                 every_rank: Sequence[int] = ()) -> list[int]:
    """The local rank owning each update group: `owner_of_groups` of the groups' trainable
    master bytes. The split update and the store's placement by owner (before the masters
    exist: sized by `master_dtype`) both ask here."""
    return owner_of_groups(group_master_bytes(groups), ranks, every_rank=every_rank)


def group_master_bytes(groups: Sequence[Sequence[nn.Parameter]]) -> list[int]:
    """Each group's trainable master bytes (sized by `master_dtype`: before the masters
    exist too), what ownership balances."""
    return [sum(p.numel() * master_dtype(p).itemsize for p in g if p.requires_grad)
            for g in groups]
