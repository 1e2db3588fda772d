"""`HomedMasters`: the masters a node store's ranks home on NVMe, gathered for a full
state dict.

Where the plan homes a layer's masters and moments on NVMe, the node store holds the
layer's compute copy alone and the local rank that updates it keeps its masters in its
own files (`engine.attach`'s `NodeCopies`); the other ranks hold placeholders. A full
state dict (`Accelerator.get_state_dict`, the Trainer's saves) therefore broadcasts each
such master from its owner, read from its file, to the node's ranks, layer by layer, as
ZeRO-3 gathers its partitions. Docs: docs/user_guide.md "9. When the state is larger
than RAM".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from lazytrain_accel.distributed.node_exchange import broadcast_masters
from lazytrain_accel.distributed.ownership import NodeGroups
from lazytrain_accel.distributed.peer_sync import NodePeers
from lazytrain_accel.engine.memory.optimizer_files import NvmeMasters
from lazytrain_accel.engine.memory.weights import NodeCopies


class HomedEngine(Protocol):
    """What `HomedMasters` needs of the engine (`StreamingEngine`)."""

    node_copies: NodeCopies | None
    masters: NvmeMasters


class HomedMasters:
    """The gather of a node's homed masters (`gather`), from the owners `owners[g]`."""

    def __init__(self, engine: HomedEngine, *, owners: Sequence[int], layout: NodeGroups,
                 peers: NodePeers) -> None:
        self._engine = engine
        self._owners = owners
        self._layout = layout
        self._peers = peers

    def gather(self, groups: Sequence[Sequence[nn.Parameter]]
               ) -> dict[nn.Parameter, torch.Tensor]:
        """Every homed layer's fp32 masters on every local rank, from the rank that
        updates each. Collective over the node: every rank calls it at the same point,
        with no update running."""
        copies = self._engine.node_copies
        if copies is None:
            return {}
        values: dict[nn.Parameter, torch.Tensor] = {}
        for layer in sorted(copies.copies):
            owner = self._owners[layer]
            in_file = (self._engine.masters.read_values(layer)
                       if owner == self._layout.local_rank else None)
            values |= broadcast_masters(groups[layer], src=self._layout.node_ranks[owner],
                                        peers=self._peers, in_file=in_file,
                                        group=self._layout.intra)
        return values
