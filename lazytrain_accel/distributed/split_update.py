"""The optimizer update split across the local ranks that share a `NodeStore`.

Ownership is `planning/node.py:owner_of_groups` (the simulator's rule too): contiguous
runs of groups in forward order, balanced by bytes; device-homed groups are every rank's
(`EVERY_RANK`). `ShareReducer` sends each layer's gradients to their owner as they land,
overlapped with the backward, then, across nodes, all-reduces each share among its
owners. The global norm is one process's, bit for bit (`gather`, `combine_norms`).
`NodePeers`: a group is read only once its owner's generation reaches the step (release
store, acquire loads: `GenerationWords`); a dead owner is named within `LIVENESS_CHECK_S`.
Design: docs/architecture.md "Several ranks on a node"; docs/user_guide.md "7. Several GPUs".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel.distributed.data_parallel import (
    GradReadyHooks,
    adopt_mean_grads,
    flat_grads,
    reduce_device,
    write_mean_grads,
)
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.distributed.node_store import pid_alive
from lazytrain_accel.engine.memory.weights import master_dtype
from lazytrain_accel.engine.step.coordinator import StepCoordinator
from lazytrain_accel.optim.clipping import clip_coefficient, combine_norms, tensor_norms
from lazytrain_accel.planning.node import EVERY_RANK, owner_of_groups

#: Longest sleep between two polls of a peer's generation.
_POLL_MAX_S = 1e-3
#: A live peer's update taking longer than this is taken for a hung rank.
OWNER_WAIT_TIMEOUT_S = 1800.0
#: How often a waiter checks that the owner it waits for still runs.
LIVENESS_CHECK_S = 0.5
#: Reduces of layers another rank owns that may be in flight at once on a rank: each
#: holds that layer's flattened fp32 gradients until it completes.
MAX_FOREIGN_IN_FLIGHT = 2


@dataclass(frozen=True, kw_only=True)
class NodeGroups:
    """The launch as nodes x local ranks. `node_ranks[l]`: the global rank of this node's
    local rank l; `intra`: this node's process group, `cross`: this local rank's group
    across the nodes (None, the default group and no cross group, with one node)."""

    local_rank: int
    node: int
    nodes: int
    node_ranks: tuple[int, ...]
    intra: Any = None
    cross: Any = None

    @property
    def local_size(self) -> int:
        return len(self.node_ranks)


def node_groups(*, local_rank: int, local_world_size: int, node_id: str) -> NodeGroups:
    """This rank's place in the launch and its 2-D process groups. Nodes are told apart by
    `node_id` (`node_store.launch_identity`, the name the segment is keyed by), numbered
    in order of their lowest global rank; every node must hold local ranks
    0..`local_world_size`-1. Every rank calls this (`new_group` is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if local_world_size == world:  # one node: the default group, no second stage
        return NodeGroups(local_rank=rank, node=0, nodes=1, node_ranks=tuple(range(world)))
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
    nodes = list(members)  # insertion order: by lowest global rank
    intra = cross = None
    for node in nodes:  # every rank creates every group, in the same order
        group = dist.new_group(members[node])
        if node == node_id:
            intra = group
    for local in range(local_world_size):
        group = dist.new_group([members[node][local] for node in nodes])
        if local == local_rank:
            cross = group
    return NodeGroups(local_rank=local_rank, node=nodes.index(node_id), nodes=len(nodes),
                      node_ranks=tuple(members[node_id]), intra=intra, cross=cross)


class NodePeers:
    """This node's other local ranks as the engine's `PeerUpdates` sees them
    (`engine/step/coordinator.py`, a Protocol): per-group update generations in the node
    store, written by owners, read by all."""

    def __init__(self, generations: GenerationWords, owners: Sequence[int], rank: int, *,
                 pids: Sequence[int]) -> None:
        self._generations = generations  # in the node store, shared by the local ranks
        self._owners = list(owners)
        self._rank = rank
        self._pids = list(pids)  # of each local rank
        self._applied = 0  # steps applied so far (every rank skips the same steps)

    def owns(self, group: int) -> bool:
        return self._owners[group] in (self._rank, EVERY_RANK)

    @property
    def foreign_groups(self) -> list[int]:
        return [g for g in range(len(self._owners)) if not self.owns(g)]

    def begin_step(self) -> None:
        """An applied (not skipped) step begins: every group's next read needs it."""
        self._applied += 1

    def publish(self, group: int) -> None:
        """This rank has updated `group` (owned) for the current step: called after the
        group's writes, on the thread that made them or one that joined it."""
        if self._owners[group] == self._rank:
            self._generations.publish(group, self._applied)

    def publish_all(self) -> None:
        for g in range(len(self._owners)):
            self.publish(g)

    def is_ready(self, group: int) -> bool:
        """Whether `group` may be read now (an acquire load: when True, its owner's
        writes of this step are visible to this thread)."""
        return self.owns(group) or self._generations.read(group) >= self._applied

    def wait(self, group: int) -> None:
        """Block until `group`'s owner has updated it for every applied step; raise
        naming the owner when its process is gone or it hangs."""
        sleep_s = 1e-5
        start = checked = time.monotonic()
        while not self.is_ready(group):
            owner, now = self._owners[group], time.monotonic()
            if now - checked > LIVENESS_CHECK_S:
                checked = now
                if not pid_alive(self._pids[owner]):
                    raise RuntimeError(
                        f"local rank {owner} (pid {self._pids[owner]}) died while this rank "
                        f"(rank {self._rank}) waited for its update of parameter group "
                        f"{group}; stopping (see rank {owner}'s log and the launcher's "
                        "report; resume from the last checkpoint)")
            if now - start > OWNER_WAIT_TIMEOUT_S:
                raise RuntimeError(
                    f"local rank {owner} (pid {self._pids[owner]}) has not updated "
                    f"parameter group {group} for {OWNER_WAIT_TIMEOUT_S:.0f} s and still "
                    "runs: it hangs (see its log)")
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _POLL_MAX_S)

    def wait_all(self) -> None:
        for g in range(len(self._owners)):
            self.wait(g)

    def named_failure(self, err: RuntimeError) -> RuntimeError:
        """`err` of a collective, restated naming the local ranks whose process is gone
        (gloo says only "connection reset by peer"); `err` itself when all run."""
        dead = [(r, pid) for r, pid in enumerate(self._pids) if not pid_alive(pid)]
        if not dead:
            return err
        names = ", ".join(f"local rank {r} (pid {pid})" for r, pid in dead)
        return RuntimeError(f"{names} died mid-step; rank {self._rank} stops (see the "
                            f"launcher's report; resume from the last checkpoint): {err}")


class ShareHooks(GradReadyHooks, Protocol):
    """What the reducer needs of the engine (`StreamingEngine`)."""

    def grad_sq_norms(self) -> dict[nn.Parameter, float]: ...

    def release_grads(self, params: list[nn.Parameter]) -> None: ...


class ShareReducer:
    """Overlapped per-layer gradient reduce to each group's owner (docs/architecture.md
    "Several ranks on a node")."""

    def __init__(self, engine: ShareHooks, groups: Sequence[Sequence[nn.Parameter]],
                 owners: Sequence[int], *, peers: NodePeers, layout: NodeGroups,
                 should_reduce: Callable[[], bool]) -> None:
        self._world_size = dist.get_world_size()
        self._layout = layout
        self._rank = layout.local_rank  # owners are local ranks
        self._engine = engine
        self._peers = peers  # names a dead rank when a collective fails
        self._groups = [list(g) for g in groups]
        self._owner_of = {p: owner for g, owner in zip(groups, owners, strict=True)
                          for p in g}
        self._should_reduce = should_reduce
        # (work, flat, params, owner) in launch order for the groups this rank owns (and
        # every-rank groups); `_crossed` of them have had their second stage (across the
        # nodes) launched. `_foreign`: reduces of other ranks' groups still in flight.
        self._pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter], int]] = []
        self._foreign: list[tuple[dist.Work, torch.Tensor]] = []
        self._crossed = 0
        self._across: list[dist.Work] = []
        self._reduced: set[nn.Parameter] = set()
        self._norm_tables: tuple[dict[nn.Parameter, float], dict[nn.Parameter, float]
                                 ] | None = None
        self._backend_device = reduce_device()
        engine.register_grad_ready_hook(self._on_layer_grads)

    def _on_layer_grads(self, params: list[nn.Parameter]) -> None:
        if self._should_reduce():
            self._launch([p for p in params if p.grad is not None])
            self._cross_nodes(block=False)

    def _launch(self, params: list[nn.Parameter]) -> None:
        by_owner: dict[int, list[nn.Parameter]] = {}
        for p in params:
            by_owner.setdefault(self._owner_of.get(p, EVERY_RANK), []).append(p)
        for owner, ps in by_owner.items():
            flat = flat_grads(ps, self._backend_device)
            if owner == EVERY_RANK:  # every rank of every node: one all-reduce
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
                self._pending.append((work, flat, ps, owner))
                self._reduced.update(ps)
                continue
            # `flat` holds them now (a copy): no second copy in flight, none kept
            self._engine.release_grads(ps)
            work = dist.reduce(flat, dst=self._layout.node_ranks[owner],
                               op=dist.ReduceOp.SUM, group=self._layout.intra,
                               async_op=True)
            if owner == self._rank:
                self._pending.append((work, flat, ps, owner))
            else:
                self._foreign.append((work, flat))
            self._reduced.update(ps)
        self._release_foreign(keep=MAX_FOREIGN_IN_FLIGHT)

    def _release_foreign(self, *, keep: int) -> None:
        """Drop the send buffers of other ranks' groups whose reduce has completed,
        oldest first, waiting while more than `keep` are in flight."""
        while self._foreign:
            work, _ = self._foreign[0]
            if len(self._foreign) <= keep and not work.is_completed():
                return
            self._wait(work)
            del self._foreign[0]

    def held_grad_bytes(self) -> int:
        """Bytes of the flattened gradients this reducer holds now (its own groups'
        buffers awaiting `finish`, other ranks' in flight)."""
        return sum(flat.numel() * flat.element_size()
                   for flat in [f for _, f, _, _ in self._pending]
                   + [f for _, f in self._foreign])

    def _cross_nodes(self, *, block: bool) -> None:
        """Launch, in launch order, the across-nodes all-reduce of each of this rank's
        groups whose reduce within the node has completed (all of them when `block`):
        the owners of a share on every node issue the same collectives in the same order."""
        if self._layout.nodes == 1:
            return
        while self._crossed < len(self._pending):
            work, flat, _, owner = self._pending[self._crossed]
            if owner == self._rank:
                if not block and not work.is_completed():
                    return
                self._wait(work)
                self._across.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM,
                                                    group=self._layout.cross, async_op=True))
            self._crossed += 1

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self._peers.named_failure(err) from err

    def finish(self) -> None:
        """Reduce what the hooks did not cover (residents), wait; owners take the mean
        as `.grad` and re-measure the engine's norms; the others hold no gradients."""
        groups_rest = [p for g in self._groups for p in g
                       if p.grad is not None and p not in self._reduced]
        self._launch(groups_rest)
        self._cross_nodes(block=True)
        for work in self._across:
            self._wait(work)
        self._release_foreign(keep=0)
        for work, flat, params, owner in self._pending:
            self._wait(work)
            if owner == EVERY_RANK:
                write_mean_grads(flat, params, self._world_size)
            else:
                adopt_mean_grads(flat, params, self._world_size)
            self._engine.refresh_grad_sq_norms(params)
        self._pending.clear()
        self._across.clear()
        self._crossed = 0
        self._reduced.clear()
        self._norm_tables = None

    def _counts(self, p: nn.Parameter) -> bool:
        """Whether this rank contributes `p` to the global norm: its owner on the first
        node (each node's owners hold the same reduced share); rank 0 for every-rank
        groups."""
        owner = self._owner_of[p]
        return self._layout.node == 0 and (
            owner == self._rank or (owner == EVERY_RANK and self._rank == 0))

    def gather(self, *tables: Mapping[nn.Parameter, float]
               ) -> list[dict[nn.Parameter, float]]:
        """Every rank's `tables` (per-parameter values of the gradients it holds) merged,
        on every rank: one `all_reduce` of a float64 vector holding, per parameter, which
        table has it (1-based, 0: none) and its value, written by the rank that counts it
        (`_counts`) and 0 on the others, so each sum is that rank's value exactly (inf and
        nan included). Every rank calls at the same point."""
        params = list(self._owner_of)
        which = torch.zeros(len(params), dtype=torch.float64)
        values = torch.zeros(len(params), dtype=torch.float64)
        for i, p in enumerate(params):
            for t, table in enumerate(tables):
                if p in table and self._counts(p):
                    which[i], values[i] = t + 1, table[p]
        both = torch.cat([which, values]).to(self._backend_device)
        try:
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
        except RuntimeError as err:
            raise self._peers.named_failure(err) from err
        which, values = both.cpu().view(2, -1).tolist()
        if any(w not in range(len(tables) + 1) for w in which):
            raise RuntimeError("two ranks counted the same parameter's gradient norm: the "
                               "ranks disagree on the parameter owners")
        merged: list[dict[nn.Parameter, float]] = [{} for _ in tables]
        for p, w, value in zip(params, which, values, strict=True):
            if w:
                merged[int(w) - 1][p] = value
        return merged

    def grad_norm_tables(self) -> tuple[dict[nn.Parameter, float],
                                        dict[nn.Parameter, float]]:
        """(norms measured now, squared norms the engine measured as they landed) of every
        parameter's reduced gradient, from its owner: what one process's clipping
        (`HybridAdamW8bit.grad_norm`) reads. Gathered once per step, by the first caller
        after `finish`."""
        if self._norm_tables is None:
            known = self._engine.grad_sq_norms()
            mine = [p for p in self._owner_of if p.grad is not None and self._counts(p)]
            sq = {p: known[p] for p in mine if p in known}
            to_measure = [p for p in mine if p not in known]
            measured = {p: float(n) for p, n in zip(
                to_measure, tensor_norms([p.grad for p in to_measure]), strict=True)}
            self._norm_tables = tuple(self.gather(measured, sq))
        return self._norm_tables

    def global_grad_sq_norm(self) -> float:
        """Squared L2 norm of the whole reduced gradient (the non-finite guard's)."""
        measured, sq = self.grad_norm_tables()
        return sum(n * n for n in measured.values()) + sum(sq.values())


def share_owners(groups: Sequence[Sequence[nn.Parameter]], ranks: int, *,
                 every_rank: Sequence[int] = ()) -> list[int]:
    """The local rank owning each update group: `owner_of_groups` of the groups' trainable
    master bytes. The split update and the store's placement by owner (before the masters
    exist: sized by `master_dtype`) both ask here."""
    return owner_of_groups([sum(p.numel() * master_dtype(p).itemsize for p in g
                                if p.requires_grad) for g in groups],
                           ranks, every_rank=every_rank)


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


def clip_shares(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float,
                reducer: ShareReducer) -> torch.Tensor:
    """`clip_grad_norm_` where this rank holds only its share's gradients: each
    gradient's norm from its owner (`ShareReducer.gather`), combined in the order of
    `parameters` as `torch.nn.utils.clip_grad_norm_` does on one process (so the same
    norm and coefficient, bit for bit), the coefficient applied to the local share."""
    if norm_type != 2:
        raise ValueError(f"norm_type={norm_type}: a split update clips by the L2 norm only; "
                         "use norm_type=2 or LazyTrainPlugin(node_store='off')")
    params = list(parameters)
    local = [p for p in params if p.grad is not None]
    grads = [p.grad for p in local]
    # torch's own per-tensor norms (clip_grad_norm_'s call), as one process computes them
    norms = torch._foreach_norm(grads, 2.0) if grads else []
    (every,) = reducer.gather({p: float(n) for p, n in zip(local, norms, strict=True)})
    norm = combine_norms([torch.tensor(every[p], dtype=torch.float32) for p in params
                          if p in every])
    coef = clip_coefficient(norm, float(max_norm))
    if grads:
        torch._foreach_mul_(grads, coef)
    return norm
