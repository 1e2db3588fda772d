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

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel.distributed.node_store import is_placeholder
from lazytrain_accel.distributed.ownership import NodeGroups
from lazytrain_accel.distributed.peer_sync import NodePeers
from lazytrain_accel.planning.node import EVERY_RANK


class NodeExchange:
    """This rank's part of the split layout's broadcasts (the engine's `RemoteUpdates`,
    `engine/step/coordinator.py`)."""

    def __init__(self, layout: NodeGroups, *, owners: Sequence[int],
                 node_of: Sequence[int], peers: NodePeers,
                 rank_of: Mapping[tuple[int, int], int] | None = None,
                 sends_copies: bool = False,
                 read_masters: Callable[[int], Mapping[tuple[nn.Parameter, str | None],
                                                       torch.Tensor]] | None = None) -> None:
        if layout.exchange is None:
            raise ValueError("the split layout needs the exchange groups: build the "
                             "launch's groups with node_groups(..., split=True)")
        self._layout = layout
        self._node_of = list(node_of)
        self._owners = list(owners)
        self._mine = [owner == layout.local_rank for owner in owners]
        self._peers = peers  # names a dead local rank when a broadcast fails
        #: (node, local rank) -> global rank, for `gather_masters`
        self._rank_of = dict(rank_of or {})
        #: whether the layers' compute copies are sent (each node holding the masters of
        #: those it updates alone), the same on every rank
        self._sends_copies = sends_copies
        #: layer -> its masters (and moments) as its file on NVMe holds them, {} where
        #: they are in DRAM (`NvmeMasters.read_values`)
        self._read_masters = read_masters or (lambda layer: {})

    @property
    def sends_copies(self) -> bool:
        """Whether the layers' compute copies are sent in place of their masters, so that
        no node holds every master (`gather_masters` then gathers them)."""
        return self._sends_copies

    def gather_masters(self, groups: Sequence[Sequence[nn.Parameter]]
                       ) -> dict[nn.Parameter, torch.Tensor]:
        """The fp32 masters this rank does not hold (placeholders: the layers another node
        updates, held here as their compute copy; those another rank homes on its drive),
        each broadcast from the rank that updates it to every rank, layer by layer (read
        from its file there where homed on NVMe); an empty dict where every node holds
        every master. Collective: every rank calls it at the same point, with no update
        running (a full `state_dict`, as FSDP's full state dict or ZeRO-3's gather)."""
        if not self._sends_copies:
            return {}
        values: dict[nn.Parameter, torch.Tensor] = {}
        for g, params in enumerate(groups):
            node = self._node_of[g]
            if node == EVERY_RANK or not 0 < g < len(groups) - 1:
                continue  # the residents' masters are on every node
            src = self._rank_of[node, self._owners[g]]
            in_file = self._read_masters(g) if dist.get_rank() == src else None
            for p, value in broadcast_masters(params, src=src, peers=self._peers,
                                              in_file=in_file).items():
                if is_placeholder(p.data) or (in_file is not None and (p, None) in in_file):
                    values[p] = value
        return values

    def updates_here(self, group: int) -> bool:
        """Whether this node updates `group` (of any local rank)."""
        return self._node_of[group] in (self._layout.node, EVERY_RANK)

    def is_remote(self, group: int) -> bool:
        """Whether `group` is this local rank's and another node updates it: this rank
        receives its new weights instead of updating it."""
        return self._mine[group] and not self.updates_here(group)

    def exchanges(self, group: int) -> bool:
        """Whether this rank sends or receives `group`'s new weights (`start`)."""
        return self._mine[group] and self._node_of[group] != EVERY_RANK

    def sends(self, group: int) -> bool:
        """Whether this rank updates `group` and sends its new weights to the others."""
        return self._mine[group] and self.updates_here(group) \
            and self._node_of[group] != EVERY_RANK

    def start(self, group: int, params: Sequence[nn.Parameter],
              copy: torch.Tensor | None = None) -> Exchange | None:
        """Start broadcasting `params` (group `group`'s updated parameters) from the node
        that updated them to this local rank on every other node, each tensor in place
        (a receiver's into its own), and return at once; None for a group of another
        local rank's, or every rank's. `copy`: the layer's whole compute copy, sent in
        their place where the other nodes hold no masters of it (below fp32 compute:
        the sender's written by its update, a receiver's its node's `NodeStore.copies`).
        Every local rank l of every node starts them for its groups in the same order
        (forward order: a receive as soon as reached, a send once updated), so the nodes
        update their parts side by side."""
        if not params or not self.exchanges(group):
            return None
        if (copy is not None) != (self._sends_copies and 0 < group < len(self._node_of) - 1):
            raise ValueError(f"group {group}: the split layout sends "
                             f"{'the compute copy' if self._sends_copies else 'the masters'} "
                             "of a decoder layer; the caller gave "
                             f"{'a copy' if copy is not None else 'none'}")
        src = self._layout.cross_ranks[self._node_of[group]]
        tensors = [p.detach() for p in params] if copy is None else [copy]
        try:
            works = [dist.broadcast(t, src=src, group=self._layout.exchange, async_op=True)
                     for t in tensors]
        except RuntimeError as err:
            raise self._peers.named_failure(err) from err
        received = None if self.sends(group) or copy is not None else list(params)
        return Exchange(works, received, self._peers)


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


def broadcast_masters(params: Sequence[nn.Parameter], *, src: int, peers: NodePeers,
                      in_file: Mapping[tuple[nn.Parameter, str | None], torch.Tensor] | None,
                      group: dist.ProcessGroup | None = None
                      ) -> dict[nn.Parameter, torch.Tensor]:
    """The fp32 masters of `params` (the trainable floats: frozen weights are in every
    store) broadcast from global rank `src` over `group`, a tensor at a time: on `src`
    (`in_file` not None) its own, those its layer's file holds read from there; on the
    others received. Collective: every rank of `group` calls it alike."""
    values: dict[nn.Parameter, torch.Tensor] = {}
    for p in params:
        if not (p.requires_grad and p.is_floating_point()):
            continue
        value = (in_file.get((p, None), p.detach()) if in_file is not None
                 else torch.empty(p.shape, dtype=torch.float32))
        try:
            peers.wait_work(dist.broadcast(value, src=src, group=group, async_op=True))
        except RuntimeError as err:
            raise peers.named_failure(err) from err
        values[p] = value
    return values


def refuse_partial_state_dicts(model: nn.Module) -> None:
    """Make `model.state_dict()` raise, naming the way, where it would hand out the
    placeholders of masters another process holds (another node's under the split layout
    below fp32 compute; another local rank's where the plan homes them on NVMe) instead
    of weights; `state_dict(keep_vars=True)` (the parameters themselves, as the engine's
    checkpoints read them) is left as it is."""

    def refuse(_: nn.Module, state_dict: dict, prefix: str, local_metadata: object) -> None:
        held = [name for name, value in state_dict.items()
                if not isinstance(value, nn.Parameter) and isinstance(value, torch.Tensor)
                and is_placeholder(value)]
        if held:
            raise RuntimeError(
                f"{len(held)} weights of this model (first: {held[0]}) live in other "
                "processes (node_layout='split' below fp32 compute: each node holds the "
                "masters of the layers it updates, and the others as their compute copy; "
                "masters homed on NVMe: on the drive of the local rank that updates them); "
                "call accelerator.get_state_dict(model) on every rank, which gathers them "
                "(as accelerator.save_model and the Trainer's saves do)")

    model.register_state_dict_post_hook(refuse)
