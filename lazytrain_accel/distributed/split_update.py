"""The optimizer update split across the local ranks that share a `NodeStore`.

`start_split_update` wires the three parts on each rank: who owns which update group
(`ownership.py`), the waits for the other owners' updates (`peer_sync.py`, installed as
the engine's peers) and the gradient reduce to each group's owner (`grad_reduce.py`).
Design: docs/architecture.md "Several ranks on a node"; docs/user_guide.md "7. Several GPUs".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.distributed.grad_reduce import ShareHooks, ShareReducer
from lazytrain_accel.distributed.ownership import NodeGroups, share_owners
from lazytrain_accel.distributed.peer_sync import NodePeers
from lazytrain_accel.engine.step.coordinator import StepCoordinator


class SplitEngine(ShareHooks, Protocol):
    """What `start_split_update` needs of the engine (`StreamingEngine`)."""

    steps: StepCoordinator
    device: torch.device


def start_split_update(engine: SplitEngine, *, generations: GenerationWords,
                       should_reduce: Callable[[], bool],
                       layout: NodeGroups | None = None) -> ShareReducer:
    """Give this rank its share (`owner_of_groups` over the node's local ranks, by
    trainable bytes), make the engine's update skip and wait for the other shares, route
    gradients to their owners (`layout`: the launch's nodes; None: one node)."""
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
    peers = NodePeers(generations, owners, layout.local_rank, pids=pids)
    engine.steps.peers = peers
    return ShareReducer(engine, groups, owners, peers=peers, layout=layout,
                        should_reduce=should_reduce)
