"""`NodeLayout`: how a launch's ranks share host copies of the model, decided once.

With `node_store="auto"` a node's local ranks map one host copy (the node store); else,
or when the `node_store_dir` cannot hold it, each rank keeps its own copy and the
gradients are all-reduced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch
from torch import nn

from lazytrain_accel import preflight
from lazytrain_accel.config import ANONYMOUS_SEGMENT, LazyTrainConfig
from lazytrain_accel.distributed import generation_words, node_store, ranks
from lazytrain_accel.distributed.ownership import (
    layers_elsewhere,
    node_members,
    share_owners,
    split_groups,
)
from lazytrain_accel.engine.memory.residents import update_groups
from lazytrain_accel.engine.model.discovery import find_decoder_layers
from lazytrain_accel.planning.node import EVERY_RANK

logger = logging.getLogger("lazytrain_accel")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeLayout:
    #: the local ranks planned as one node sharing one host copy (1: this rank alone)
    node_ranks: int = 1
    #: the nodes of the launch, each with its own copy (`node_ranks` ranks each)
    nodes: int = 1
    #: the node_store_dir that cannot hold the store (each rank its own copy instead)
    segment_room: preflight.SegmentRoom | None = None


def node_layout_for(config: LazyTrainConfig, model: nn.Module, *, num_processes: int,
                    is_main_process: bool) -> NodeLayout:
    """The local ranks that will share one host copy: a node's processes
    (LOCAL_WORLD_SIZE) with `node_store="auto"`, each node its own copy, else 1 (each
    rank its own copy; also when the `node_store_dir` cannot hold it, `segment_room`)."""
    if num_processes == 1:
        return NodeLayout()
    why_not = node_store.unusable_because(config.node_store, num_processes=num_processes,
                                          env=os.environ, store_dir=config.node_store_dir)
    warn = False
    if why_not is None and (unsafe := generation_words.unavailable_because()):
        why_not, warn = f"the node store is refused: {unsafe}", True
    segment_room = None
    if why_not is None and config.node_store_dir != ANONYMOUS_SEGMENT:
        room = node_store.room_for(model, config.node_store_dir)
        if not room.fits:
            segment_room = room
            why_not = f"{room.directory} cannot hold the node store"
    # Every rank's finding, in one meeting every rank attends whatever it found (nodes may
    # be given other settings): one rank that cannot share makes every rank keep its own.
    found = ranks.gathered((ranks.this_rank(), why_not, warn, segment_room))
    refused = [f for f in found if f[1] is not None]  # (where, why_not, warn, segment_room)
    if not refused:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        return NodeLayout(node_ranks=local, nodes=num_processes // local)
    where, why_not, warn, segment_room = refused[0]
    if is_main_process:
        (logger.warning if warn else logger.info)(
            "lazytrain: each rank keeps its own host copy and the whole update "
            "(gradients all-reduced): %s%s", why_not,
            "" if len(refused) == len(found) else
            f" (on {where}; {len(refused)} of {len(found)} ranks)")
    return NodeLayout(segment_room=segment_room)


def share_store(config: LazyTrainConfig, model: nn.Module, layout: NodeLayout, *,
                local_process_index: int, is_main_process: bool, num_groups: int,
                device: torch.device, resident_update: str,
                copies_dtype: torch.dtype | None = None, split_copies: bool = False,
                homed: frozenset[int] = frozenset()) -> node_store.NodeStore | None:
    """Map the parameters from the node's shared segment (`layout.node_ranks` > 1), else
    None: every rank keeps its own copy (all-reduce). On a multi-socket host the leader
    places each group's bytes on its owner's NUMA node (`segment_nodes`). Held as their
    compute copy alone in `copies_dtype` (`node_store.Elsewhere`): with `split_copies`
    (the split layout over several nodes, the update writing compute copies) the layers
    another node updates, and the layers `homed` (whose masters and moments the plan
    homes on NVMe, each on the drive of the rank that updates it)."""
    if layout.node_ranks == 1:
        return None
    directory = config.node_store_dir
    if is_main_process:
        logger.info("lazytrain: %s", node_store.room_for(model, directory).describe())
    job_id, node_id = node_store.launch_identity(os.environ)
    rank_nodes = ranks.local_numa_nodes(local_rank=local_process_index, node_id=node_id)
    leader = local_process_index == 0
    nodes = (segment_nodes(model, rank_nodes, device=device, resident_update=resident_update)
             if leader and rank_nodes is not None else None)
    elsewhere = None
    split = split_copies and layout.nodes > 1
    if split or homed:
        if copies_dtype is None:
            raise ValueError("the node store holds compute copies only below fp32 compute")
        elsewhere = held_elsewhere(model, layout, local_rank=local_process_index,
                                   node_id=node_id, device=device,
                                   resident_update=resident_update, dtype=copies_dtype,
                                   split=split, homed=homed)
    return node_store.share_model(
        model, name=node_store.segment_name(job_id=job_id, node_id=node_id),
        leader=leader, local_ranks=layout.node_ranks,
        num_groups=num_groups,
        agree=lambda error: ranks.raise_if_any_failed(error, "open the node store"),
        directory=None if directory == ANONYMOUS_SEGMENT else Path(directory), nodes=nodes,
        elsewhere=elsewhere)


def held_elsewhere(model: nn.Module, layout: NodeLayout, *, local_rank: int, node_id: str,
                   device: torch.device, resident_update: str, dtype: torch.dtype,
                   split: bool, homed: frozenset[int]) -> node_store.Elsewhere:
    """The decoder layers held here as their compute copy in `dtype`: with `split`, those
    another node updates (the split update's own cut, `ownership.split_groups`, over this
    launch's nodes); and those `homed` on NVMe, whose masters this rank keeps (for its
    drive) where it updates them. Collective: the nodes are numbered from every rank's id."""
    from lazytrain_accel.engine.memory import quantized

    groups = update_groups(model, *find_decoder_layers(model))
    if any(quantized.is_packed(p) for g in groups for p in g):
        raise ValueError("the node store holds layers as their compute copy (the split "
                         "layout below fp32 compute, masters homed on NVMe), which a packed "
                         "frozen base (frozen_weights nf4/int8) is not built for; use "
                         "node_layout='replicated' with the masters in DRAM")
    members = node_members(local_rank=local_rank, local_world_size=layout.node_ranks,
                           node_id=node_id)
    node = list(members).index(node_id)
    owners, node_of = split_groups(groups, local_ranks=layout.node_ranks, nodes=layout.nodes,
                                   every_rank=_every_rank(groups, device, resident_update))
    layers = dict(layers_elsewhere(groups, node_of, node)) if split else {}
    layers |= {j: groups[j] for j in homed}
    kept = frozenset(j for j in homed if owners[j] == local_rank
                     and (not split or node_of[j] == node))
    return node_store.Elsewhere(layers=layers, dtype=dtype, kept=kept)


def _every_rank(groups: list[list[nn.Parameter]], device: torch.device,
                resident_update: str) -> tuple[int, ...]:
    """The groups every rank updates: the residents, where their masters live on each GPU
    (as `start_split_update` decides from the engine's device groups)."""
    resident = groups[0] + groups[-1]
    return (0, len(groups) - 1) if (
        device.type != "cpu" and resident_update == "device"
        and any(p.requires_grad and p.is_floating_point() for p in resident)) else ()


def segment_nodes(model: nn.Module, rank_nodes: list[int], *, device: torch.device,
                  resident_update: str) -> list[int | None]:
    """The NUMA node of each of the store's parameters (`node_store.shared_params`): that
    of the local rank owning its update group (`ownership.share_owners`, the split
    update's rule, over the engine's update groups); None for a group every rank updates
    (residents with their masters on each GPU, as `start_split_update` decides)."""
    groups = update_groups(model, *find_decoder_layers(model))
    owners = share_owners(groups, len(rank_nodes),
                          every_rank=_every_rank(groups, device, resident_update))
    node_of = {id(p): None if owner == EVERY_RANK else rank_nodes[owner]
               for group, owner in zip(groups, owners, strict=True) for p in group}
    return [node_of.get(id(p)) for _, p in node_store.shared_params(model)]
