"""The split layout's weights across nodes: each group updated on one node, sent to all.

Under `node_layout="split"` the group g of local rank l (`ownership.share_owners`) is
updated by local rank l of node `node_of[g]` alone (`planning/node.py:node_of_groups`):
only that node holds its moments and its reduced gradient (`grad_reduce.py` reduces the
gradient there). `NodeExchange` then broadcasts the group's new weights from that rank
to the local ranks l of the other nodes, which write them into their own node store
(where their local peers wait for them as for any owner's update). Each local rank l
walks its groups in forward order on its update thread, sending or receiving each, on
`NodeGroups.exchange`, a group of its own: the training thread's reduces use `cross`.
Design: docs/architecture.md "Several nodes".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel.distributed.ownership import NodeGroups
from lazytrain_accel.distributed.peer_sync import NodePeers
from lazytrain_accel.planning.node import EVERY_RANK


class NodeExchange:
    """This rank's part of the split layout's broadcasts (the engine's `RemoteUpdates`,
    `engine/step/coordinator.py`)."""

    def __init__(self, layout: NodeGroups, *, owners: Sequence[int],
                 node_of: Sequence[int], peers: NodePeers) -> None:
        if layout.exchange is None:
            raise ValueError("the split layout needs the exchange groups: build the "
                             "launch's groups with node_groups(..., split=True)")
        self._layout = layout
        self._node_of = list(node_of)
        self._mine = [owner == layout.local_rank for owner in owners]
        self._peers = peers  # names a dead local rank when a broadcast fails

    def updates_here(self, group: int) -> bool:
        """Whether this node updates `group` (of any local rank)."""
        return self._node_of[group] in (self._layout.node, EVERY_RANK)

    def is_remote(self, group: int) -> bool:
        """Whether `group` is this local rank's and another node updates it: this rank
        receives its new weights instead of updating it."""
        return self._mine[group] and not self.updates_here(group)

    def sends(self, group: int) -> bool:
        """Whether this rank updates `group` and sends its new weights to the others."""
        return self._mine[group] and self.updates_here(group) \
            and self._node_of[group] != EVERY_RANK

    def start(self, group: int, params: Sequence[nn.Parameter]) -> Exchange | None:
        """Start broadcasting `params` (group `group`'s updated parameters) from the node
        that updated them to this local rank on every other node, each tensor in place
        (a receiver's into its own), and return at once; None for a group of another
        local rank's, or every rank's. Every local rank l of every node starts them for
        its groups in the same order (forward order: a receive as soon as reached, a
        send once updated), so the nodes update their parts side by side."""
        if not params or not self._mine[group] or self._node_of[group] == EVERY_RANK:
            return None
        src = self._layout.cross_ranks[self._node_of[group]]
        try:
            works = [dist.broadcast(p.detach(), src=src, group=self._layout.exchange,
                                    async_op=True) for p in params]
        except RuntimeError as err:
            raise self._peers.named_failure(err) from err
        return Exchange(works, None if self.sends(group) else list(params), self._peers)


class Exchange:
    """A group's broadcasts under way (`NodeExchange.start`)."""

    def __init__(self, works: list[dist.Work], received: list[nn.Parameter] | None,
                 peers: NodePeers) -> None:
        self._works = works
        self._received = received  # the parameters written, on a receiving rank
        self._peers = peers

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        """Block until every broadcast is done, raising naming a dead local rank."""
        for work in self._works:
            self._peers.wait_work(work)
        for p in self._received or ():  # written behind autograd's back: a copy keyed
            torch.autograd.graph.increment_version(p)  # to them is stale
        self._works, self._received = [], None
