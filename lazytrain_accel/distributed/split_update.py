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
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from lazytrain_accel.distributed import ranks
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.distributed.grad_reduce import ShareHooks, ShareReducer
from lazytrain_accel.distributed.node_exchange import NodeExchange
from lazytrain_accel.distributed.ownership import NodeGroups, group_master_bytes, share_owners
from lazytrain_accel.distributed.peer_sync import NodePeers, RemoteRank
from lazytrain_accel.engine.step.coordinator import StepCoordinator
from lazytrain_accel.planning.node import node_of_groups


class SplitEngine(ShareHooks, Protocol):
    """What `start_split_update` needs of the engine (`StreamingEngine`)."""

    steps: StepCoordinator
    device: torch.device
    compute_dtype: torch.dtype


def start_split_update(engine: SplitEngine, *, generations: GenerationWords,
                       should_reduce: Callable[[], bool],
                       layout: NodeGroups | None = None,
                       node_layout: str = "replicated") -> ShareReducer:
    """Give this rank its share (`owner_of_groups` over the node's local ranks, by
    trainable bytes), make the engine's update skip and wait for the other shares, route
    gradients to their owners (`layout`: the launch's nodes; None: one node). Under
    `node_layout="split"` over several nodes each share is cut over the nodes
    (`node_of_groups`): a group is updated on one node and its weights sent to the
    others."""
    if engine.steps.master_files is not None and engine.steps.master_files.layers:
        raise ValueError(
            f"the plan homes masters and moments on NVMe (layers "
            f"{sorted(engine.steps.master_files.layers)}), but the local ranks share them in "
            "the node store, which one rank cannot send to its drive; plan with "
            "host_state='copies' (what several ranks home on NVMe)")
    if layout is None:
        layout = NodeGroups(local_rank=dist.get_rank(), node=0, nodes=1,
                            node_ranks=tuple(range(dist.get_world_size())))
    groups = engine.steps.update_groups
    # Device-homed residents have a master per GPU; on a CPU device they stay shared.
    on_gpus = engine.steps.device_groups if engine.device.type != "cpu" else ()
    owners = share_owners(groups, layout.local_size, every_rank=on_gpus)
    pids: list[int | None] = [None] * layout.local_size
    dist.all_gather_object(pids, os.getpid(), group=layout.intra)
    others: list[RemoteRank] = []
    if layout.nodes > 1:  # where every rank runs, for a failure to name the dead
        places: list[tuple[str, int, int, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(places, (os.uname().nodename, os.getpid(), layout.node,
                                        layout.local_rank))
        others = [RemoteRank(rank=r, node=node, local_rank=local, host=host, pid=pid)
                  for r, (host, pid, node, local) in enumerate(places) if node != layout.node]
    peers = NodePeers(generations, owners, layout.local_rank, pids=pids, others=others)
    ranks.name_failures_with(peers.named_failure)  # the control collectives name the dead
    engine.steps.peers = peers
    node_of = None
    if node_layout == "split" and layout.nodes > 1:
        if engine.compute_dtype != torch.float32:
            raise ValueError(
                f"node_layout='split' sends each group's new fp32 weights to the other "
                f"nodes, which stream them as they are: a {engine.compute_dtype} compute "
                "copy per node is not built yet; use mixed_precision='no' or "
                "node_layout='replicated'")
        if engine.steps.device_groups and not on_gpus \
                and engine.steps.device_update_beside_host:
            raise ValueError(
                "node_layout='split' on this asynchronous CPU device sends the residents' "
                "weights from the training thread while the update thread sends the "
                "layers': plan with resident_update='host'")
        node_of = node_of_groups(group_master_bytes(groups), owners, layout.nodes)
        engine.steps.remote = NodeExchange(layout, owners=owners, node_of=node_of,
                                           peers=peers)
    return ShareReducer(engine, groups, owners, peers=peers, layout=layout,
                        should_reduce=should_reduce, node_of=node_of)
