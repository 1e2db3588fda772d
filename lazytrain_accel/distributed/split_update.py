"""The optimizer update split across the local ranks that share a `NodeStore`.

`start_split_update` wires the parts on each rank: who owns which update group
(`ownership.py`), the waits for the other owners' updates (`peer_sync.py`, installed as
the engine's peers), the gradient reduce to each group's owner (`grad_reduce.py`) and,
under the split layout across nodes, the new weights' broadcast from the node that
updated each group (`node_exchange.py`, the engine's remote updates).
Design: docs/architecture.md "Several ranks on a node"; docs/user_guide.md "7. Several GPUs".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.distributed as dist

from lazytrain_accel.distributed import ranks
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.distributed.grad_reduce import ShareHooks, ShareReducer
from lazytrain_accel.distributed.homed_masters import HomedEngine, HomedMasters
from lazytrain_accel.distributed.node_exchange import NodeExchange
from lazytrain_accel.distributed.ownership import (
    NodeGroups,
    layers_elsewhere,
    split_groups,
)
from lazytrain_accel.distributed.peer_sync import NodePeers, RemoteRank
from lazytrain_accel.engine.memory.weights import WeightPool
from lazytrain_accel.engine.step.coordinator import StepCoordinator
from lazytrain_accel.planning.plan import Plan


class SplitEngine(ShareHooks, HomedEngine, Protocol):
    """What `start_split_update` needs of the engine (`StreamingEngine`)."""

    steps: StepCoordinator
    device: torch.device
    compute_dtype: torch.dtype
    pool: WeightPool
    plan: Plan


def start_split_update(engine: SplitEngine, *, generations: GenerationWords,
                       should_reduce: Callable[[], bool],
                       layout: NodeGroups | None = None,
                       node_layout: str = "replicated",
                       copies: Mapping[int, torch.Tensor] | None = None
                       ) -> tuple[ShareReducer, HomedMasters | None]:
    """Give this rank its share (`owner_of_groups` over the node's local ranks, by
    trainable bytes), make the engine's update skip and wait for the other shares, route
    gradients to their owners (`layout`: the launch's nodes; None: one node). Under
    `node_layout="split"` over several nodes each share is cut over the nodes
    (`node_of_groups`): a group is updated on one node and its weights sent to the
    others. `copies` (the node store's, `node_store.Elsewhere`; None where every node
    holds every master): a decoder layer's compute copy is sent in place of its masters,
    into `copies` on the nodes that do not update it. Returns the reducer, and where the
    ranks home masters on NVMe (`engine.node_copies`) their gather for a full state dict."""
    if layout is None:
        layout = NodeGroups(local_rank=dist.get_rank(), node=0, nodes=1,
                            node_ranks=tuple(range(dist.get_world_size())))
    groups = engine.steps.update_groups
    # Device-homed residents have a master per GPU; on a CPU device they stay shared.
    on_gpus = engine.steps.device_groups if engine.device.type != "cpu" else ()
    # the split layout's cut over the nodes too: the rule the node store laid out by
    owners, cut = split_groups(groups, local_ranks=layout.local_size, nodes=layout.nodes,
                               every_rank=on_gpus)
    split = node_layout == "split" and layout.nodes > 1
    files = engine.steps.master_files
    not_mine = sorted(j for j in (files.layers if files is not None else ())
                      if owners[j] != layout.local_rank or (split and cut[j] != layout.node))
    if not_mine:
        raise RuntimeError(f"this rank homes the masters of layers {not_mine} on its drive, "
                           "which another rank updates: the node store and the update cut "
                           "the groups differently")
    pids: list[int | None] = [None] * layout.local_size
    dist.all_gather_object(pids, os.getpid(), group=layout.intra)
    others: list[RemoteRank] = []
    rank_of: dict[tuple[int, int], int] = {}
    if layout.nodes > 1:  # where every rank runs, for a failure to name the dead
        places: list[tuple[str, int, int, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(places, (os.uname().nodename, os.getpid(), layout.node,
                                        layout.local_rank))
        others = [RemoteRank(rank=r, node=node, local_rank=local, host=host, pid=pid)
                  for r, (host, pid, node, local) in enumerate(places) if node != layout.node]
        rank_of = {(node, local): r for r, (_, _, node, local) in enumerate(places)}
    peers = NodePeers(generations, owners, layout.local_rank, pids=pids, others=others)
    ranks.name_failures_with(peers.named_failure)  # the control collectives name the dead
    engine.steps.peers = peers
    node_of = None
    if split:
        if engine.steps.device_groups and not on_gpus \
                and engine.steps.device_update_beside_host:
            raise ValueError(
                "node_layout='split' on this asynchronous CPU device sends the residents' "
                "weights from the training thread while the update thread sends the "
                "layers': plan with resident_update='host'")
        node_of = cut
        if copies is not None:
            _receive_copies(engine, copies, layers_elsewhere(groups, node_of, layout.node))
        engine.steps.remote = NodeExchange(layout, owners=owners, node_of=node_of,
                                           peers=peers, rank_of=rank_of,
                                           sends_copies=copies is not None,
                                           read_masters=engine.masters.read_values)
    reducer = ShareReducer(engine, groups, owners, peers=peers, layout=layout,
                           should_reduce=should_reduce, node_of=node_of)
    # (under the split layout the exchange gathers every master, homed ones included)
    homed = None if engine.node_copies is None or split else HomedMasters(
        engine, owners=owners, layout=layout, peers=peers)
    return reducer, homed


def _receive_copies(engine: SplitEngine, copies: Mapping[int, torch.Tensor],
                    elsewhere: Mapping[int, object]) -> None:
    """Stream the layers another node updates from `copies` (the node store's), their
    compute copies as that node sends them, where the store holds no masters of them
    (below fp32 compute, the hybrid update writing the copies); the store holds every
    layer this split sends here as such (and those homed on NVMe: `NodeCopies`)."""
    if not set(elsewhere) <= set(copies):
        raise RuntimeError(f"the node store holds the compute copies of layers "
                           f"{sorted(copies)}, but the split update sends this node layers "
                           f"{sorted(elsewhere)}: the store and the update cut the groups "
                           "differently")
    copies = {j: copies[j] for j in elsewhere}
    homed = set(copies) & set(engine.plan.state.copies)
    if homed:
        raise ValueError(f"the plan homes the compute copies of layers {sorted(homed)} on "
                         "NVMe, which under node_layout='split' this node receives from "
                         "another into its node store; plan without NVMe compute copies "
                         "(host_state) or use node_layout='replicated'")
    engine.pool.receive_copies(copies)
