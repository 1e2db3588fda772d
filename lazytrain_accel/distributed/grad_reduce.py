"""The gradient reduce of a split update: each layer's gradients to their owner.

`ShareReducer` sends each layer's gradients to their owning local rank as they land
(an asynchronous `reduce`, overlapped with the backward; at most `MAX_FOREIGN_IN_FLIGHT`
send buffers of other ranks' layers held), then, across nodes, all-reduces each share
among its owners (replicated layout) or reduces each group to the node that updates it
(split: `node_of`); owners take the mean as `.grad`. The global norm is one process's, bit
for bit: each value written by the rank that counts it (`gather`), combined in the
one-process order (`clip_shares`, `combine_norms`).
Design: docs/architecture.md "Several ranks on a node" ("Gradients", "The global norm").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

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
from lazytrain_accel.distributed.ownership import NodeGroups
from lazytrain_accel.distributed.peer_sync import NodePeers
from lazytrain_accel.optim.clipping import clip_coefficient, combine_norms, tensor_norms
from lazytrain_accel.planning.host import (
    CROSSING_CHUNK_NUMEL,
    MAX_CROSSINGS_IN_FLIGHT,
    MAX_FOREIGN_IN_FLIGHT,
)
from lazytrain_accel.planning.node import EVERY_RANK


class ShareHooks(GradReadyHooks, Protocol):
    """What the reducer needs of the engine (`StreamingEngine`)."""

    def grad_sq_norms(self) -> dict[nn.Parameter, float]: ...

    def release_grads(self, params: list[nn.Parameter]) -> None: ...

    def record_grad_sq_norms(self, params: list[nn.Parameter]) -> None: ...


class ShareReducer:
    """Overlapped per-layer gradient reduce to each group's owner (docs/architecture.md
    "Several ranks on a node")."""

    def __init__(self, engine: ShareHooks, groups: Sequence[Sequence[nn.Parameter]],
                 owners: Sequence[int], *, peers: NodePeers, layout: NodeGroups,
                 should_reduce: Callable[[], bool],
                 node_of: Sequence[int] | None = None) -> None:
        self._world_size = dist.get_world_size()
        self._layout = layout
        self._rank = layout.local_rank  # owners are local ranks
        self._engine = engine
        self._peers = peers  # names a dead rank when a collective fails
        self._groups = [list(g) for g in groups]
        self._owner_of = {p: owner for g, owner in zip(groups, owners, strict=True)
                          for p in g}
        # the node updating each parameter's group (split layout), else None: every node
        self._node_of = None if node_of is None else {
            p: node for g, node in zip(groups, node_of, strict=True) for p in g}
        self._should_reduce = should_reduce
        # (work, flat, params, owner) in launch order for the groups this rank owns (and
        # every-rank groups); `_crossed` of them have had their second stage (across the
        # nodes) launched. `_foreign`: reduces of other ranks' groups still in flight.
        # (A group sent to the node that updates it leaves with its buffer: None here,
        # held by its crossing until sent.)
        self._pending: list[tuple[dist.Work | None, torch.Tensor | None,
                                  list[nn.Parameter], int]] = []
        # split: each group's second stage runs on one thread of its own, in launch
        # order, so the hooks never wait for the other nodes (`_cross_one`)
        self._crosser = None if node_of is None else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lazytrain-cross-nodes")
        self._crossings: list[Future[None]] = []
        # the crossing thread's chunk buffers on the updating node, one per node
        self._chunks: list[torch.Tensor] | None = None
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
            if not self._reduced:  # the pass's first layer: the output side's backward is done
                self._launch(self._output_residents(exclude=params))
            self._launch([p for p in params if p.grad is not None])
            self._cross_nodes(block=False)

    def _output_residents(self, *, exclude: list[nn.Parameter]) -> list[nn.Parameter]:
        """The output side's residents (final norm, untied head: the last group), sent
        with the first layer's gradients instead of at the end of the backward, so that no
        rank holds a copy of them through it (the head of a 128k vocabulary at hidden 4096
        is 2.1 GB of fp32 gradient a rank). Only where they are the host's fp32 `.grad`
        itself (used in place, accumulated there over micro-batches): a device copy's
        gradient is folded into the host's only at the end of the pass. Their norms are
        recorded now, as the end of the pass would have (the one-process clip, bit for
        bit). A tied head is the embeddings' group, whole only at the end."""
        skip = set(exclude)
        residents = [p for p in self._groups[-1] if p.grad is not None and p not in skip]
        if any(p.grad.device.type != "cpu" or p.grad.dtype != torch.float32
               or p.dtype != torch.float32 for p in residents):
            return []
        if residents:
            self._engine.record_grad_sq_norms(residents)
        return residents

    def _launch(self, params: list[nn.Parameter]) -> None:
        by_owner: dict[int, list[nn.Parameter]] = {}
        for p in params:
            by_owner.setdefault(self._owner_of.get(p, EVERY_RANK), []).append(p)
        for owner, ps in by_owner.items():
            if owner not in (EVERY_RANK, self._rank):  # room first: at most the cap held
                self._release_foreign(keep=MAX_FOREIGN_IN_FLIGHT - 1)
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
                   for flat in [f for _, f, _, _ in self._pending if f is not None]
                   + [f for _, f in self._foreign])

    def _cross_nodes(self, *, block: bool) -> None:
        """Launch, in launch order, the second stage (across the nodes) of each of this
        rank's groups whose reduce within the node has completed (all of them when
        `block`; split: every one, its thread waiting for that reduce): the owners of a
        share on every node issue theirs in the same order."""
        if self._layout.nodes == 1:
            return
        while self._crossed < len(self._pending):
            work, flat, params, owner = self._pending[self._crossed]
            if owner == self._rank:
                if self._crosser is not None:
                    self._settle_crossings(keep=MAX_CROSSINGS_IN_FLIGHT - 1)
                    self._crossings.append(self._crosser.submit(
                        self._cross_one, work, flat, params[0]))
                    if not self._updates_here(params[0]):
                        # its buffer goes with the send (and its work, which holds it)
                        self._pending[self._crossed] = (None, None, params, owner)
                else:
                    if not block and not work.is_completed():
                        return
                    self._wait(work)
                    self._across.append(dist.all_reduce(
                        flat, op=dist.ReduceOp.SUM, group=self._layout.cross,
                        async_op=True))
            self._crossed += 1

    def _settle_crossings(self, *, keep: int) -> None:
        """Wait for the oldest crossings until at most `keep` are left (each holds its
        group's buffer until it has crossed), raising the first one's error."""
        while len(self._crossings) > keep:
            self._crossings.pop(0).result()

    def _cross_one(self, work: dist.Work, flat: torch.Tensor, first: nn.Parameter) -> None:
        """The split layout's second stage of a group's reduce (`first`: one of its
        parameters), on the crossing thread once its reduce within the node is done: the
        buffer gathered, chunk by chunk, to the node that updates it, which adds the
        others' into its own in node order. Each node sends (K - 1) / K of the gradients,
        as the model's reduce-scatter. (gloo's `reduce` reduce-scatters, then gathers to
        the root, so the root sends half of every buffer too; its point-to-point sends
        and receives never fail when their peer dies, where a collective does.)"""
        layout = self._layout
        self._wait(work)
        node = self._node_of[first]
        root = layout.cross_ranks[node]
        here = node == layout.node
        if here and (self._chunks is None or self._chunks[0].dtype != flat.dtype):
            self._chunks = [torch.empty(CROSSING_CHUNK_NUMEL, dtype=flat.dtype)
                            for _ in range(layout.nodes)]
        for start in range(0, flat.numel(), CROSSING_CHUNK_NUMEL):
            part = flat[start:start + CROSSING_CHUNK_NUMEL]
            chunks = [c[:part.numel()] for c in self._chunks] if here else None
            self._wait(dist.gather(part, chunks, dst=root, group=layout.cross,
                                   async_op=True))
            for n, chunk in enumerate(chunks or ()):
                if n != node:
                    part.add_(chunk)

    def _wait(self, work: dist.Work) -> None:
        self._peers.wait_work(work)

    def finish(self) -> None:
        """Reduce what the hooks did not cover (residents), wait; owners take the mean
        as `.grad` and re-measure the engine's norms; the others hold no gradients."""
        groups_rest = [p for g in self._groups for p in g
                       if p.grad is not None and p not in self._reduced]
        self._launch(groups_rest)
        self._cross_nodes(block=True)
        for work in self._across:
            self._wait(work)
        self._settle_crossings(keep=0)  # their errors, named (`_wait`)
        self._release_foreign(keep=0)
        for work, flat, params, owner in self._pending:
            if flat is None:  # sent to the node that updates it: none held here
                continue
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
        """Whether this rank contributes `p` to the global norm: its owner on the node
        that updates it (replicated: the first node, each node's owners holding the same
        reduced share); rank 0 for every-rank groups."""
        owner = self._owner_of[p]
        if owner == EVERY_RANK:
            return self._layout.node == 0 and self._rank == 0
        node = 0 if self._node_of is None else self._node_of[p]
        return self._layout.node == node and owner == self._rank

    def _updates_here(self, p: nn.Parameter) -> bool:
        """Whether this node updates `p`'s group (every node in the replicated layout)."""
        return self._node_of is None or self._node_of[p] == self._layout.node

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
        self._wait(dist.all_reduce(both, op=dist.ReduceOp.SUM, async_op=True))
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
