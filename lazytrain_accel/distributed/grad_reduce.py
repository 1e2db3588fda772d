"""The gradient reduce of a split update: each layer's gradients to their owner.

`ShareReducer` sends each layer's gradients to their owning local rank as they land, on
a thread of its own (overlapped with the backward), in pieces of at most
`REDUCE_PIECE_NUMEL` elements: a rank that does not keep a layer takes its landed
gradients before they become `.grad` (`GradSink.taker`), and its owner reduces into its
own `.grad` in place, so no rank holds a layer's fp32 gradients in flight. Across nodes
each piece is then all-reduced among the share's owners (replicated layout) or gathered
to the node that updates it (split: `node_of`); owners take the mean as `.grad`. The
global norm is one process's, bit for bit: each value written by the rank that counts it
(`gather`), combined in the one-process order (`clip_shares`, `combine_norms`).
Design: docs/architecture.md "Several ranks on a node" ("Gradients", "The global norm").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel.distributed.data_parallel import (
    GradReadyHooks,
    flat_grads,
    reduce_device,
    write_mean_grads,
)
from lazytrain_accel.distributed.ownership import NodeGroups
from lazytrain_accel.distributed.peer_sync import NodePeers
from lazytrain_accel.optim.clipping import clip_coefficient, combine_norms, tensor_norms
from lazytrain_accel.planning.host import MAX_REDUCES_IN_FLIGHT, REDUCE_PIECE_NUMEL
from lazytrain_accel.planning.node import EVERY_RANK


class ShareHooks(GradReadyHooks, Protocol):
    """What the reducer needs of the engine (`StreamingEngine`)."""

    def register_grad_taker(self, taker: Callable[[list[nn.Parameter], list[torch.Tensor]],
                                                  Future[None] | None]) -> None: ...

    def grad_sq_norms(self) -> dict[nn.Parameter, float]: ...

    def release_grads(self, params: list[nn.Parameter]) -> None: ...

    def record_grad_sq_norms(self, params: list[nn.Parameter]) -> None: ...


def pieces(tensors: Sequence[torch.Tensor], numel: int) -> Iterator[torch.Tensor]:
    """Each tensor's elements, flattened, in slices of at most `numel` (views of
    contiguous tensors). Never one spanning two tensors: the cut depends on the shapes
    alone, so every rank sends the same pieces, in place where its tensor is an fp32 one
    on the reduce's device, through a bucket where not."""
    for tensor in tensors:
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), numel):
            yield flat[start:start + numel]


class ShareReducer:
    """Overlapped per-layer gradient reduce to each group's owner, in bounded pieces
    (docs/architecture.md "Several ranks on a node")."""

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
        # One thread sends every group's pieces, in launch order (the same on every rank,
        # so the collectives of each process group meet): within the node, then across.
        self._sender = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix="lazytrain-reduce")
        # (job, its params, the bytes of gradients it holds that no `.grad` keeps)
        self._jobs: list[tuple[Future[None], list[nn.Parameter], int]] = []
        self._failed: BaseException | None = None  # a job's error: the later ones skip
        # the sender's buffers on the reduce's device, through a step: one piece, and one
        # per node received by the node that updates a group (split); as large as the
        # largest piece so far
        self._bucket: torch.Tensor | None = None
        self._chunks: list[torch.Tensor] | None = None
        self._kept: dict[nn.Parameter, None] = {}  # `.grad`s reduced in place, in order
        # every-rank groups: one all-reduce of a flat copy each
        self._everyone: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []
        self._reduced: set[nn.Parameter] = set()
        self._norm_tables: tuple[dict[nn.Parameter, float], dict[nn.Parameter, float]
                                 ] | None = None
        self._backend_device = reduce_device()
        engine.register_grad_ready_hook(self._on_layer_grads)
        engine.register_grad_taker(self.take)

    def _keeps(self, p: nn.Parameter) -> bool:
        """Whether this rank keeps `p`'s reduced gradient: its owner on the node that
        updates it."""
        return self._owner_of.get(p) == self._rank and self._updates_here(p)

    def take(self, params: list[nn.Parameter], grads: list[torch.Tensor]
             ) -> Future[None] | None:
        """The engine's taker (`GradSink.taker`): a layer's landed host gradients, before
        they are folded, sent to their owner from where they landed (a staging buffer,
        the backward's outputs) where this rank does not keep them and they start this
        step's sum; the send's Future (done once it no longer reads them), else None."""
        if any(p in self._reduced for p in params):
            self._settle(keep=0)  # reduced already this step: the fold meets no send
        if not self._should_reduce() or any(p.grad is not None for p in params) \
                or any(g.device.type != "cpu" for g in grads):
            return None
        owners = {self._owner_of.get(p, EVERY_RANK) for p in params}
        if len(owners) != 1 or EVERY_RANK in owners or self._keeps(params[0]):
            return None
        self._begin_pass(exclude=params)
        return self._submit(params, list(grads), owners.pop())

    def _on_layer_grads(self, params: list[nn.Parameter]) -> None:
        if self._should_reduce():
            self._begin_pass(exclude=params)
            self._launch([p for p in params if p.grad is not None])

    def _begin_pass(self, *, exclude: list[nn.Parameter]) -> None:
        if not self._reduced:  # the pass's first layer: the output side's backward is done
            self._launch(self._output_residents(exclude=exclude))

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
        """Reduce the `.grad`s of `params`: every-rank groups all-reduced whole, the
        others sent to their owner, which reduces into its `.grad` in place; a rank that
        does not keep them drops its `.grad` (the send holds it until done)."""
        by_owner: dict[int, list[nn.Parameter]] = {}
        for p in params:
            by_owner.setdefault(self._owner_of.get(p, EVERY_RANK), []).append(p)
        for owner, ps in by_owner.items():
            if owner == EVERY_RANK:  # every rank of every node: one all-reduce
                flat = flat_grads(ps, self._backend_device)
                self._everyone.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM,
                                                       async_op=True), flat, ps))
                self._reduced.update(ps)
                continue
            for p in ps:  # views of them are reduced in place
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
            grads = [p.grad for p in ps]
            if self._keeps(ps[0]):
                self._kept.update(dict.fromkeys(ps))
            else:
                self._engine.release_grads(ps)
            self._submit(ps, grads, owner)

    def _submit(self, params: list[nn.Parameter], grads: list[torch.Tensor],
                owner: int) -> Future[None]:
        """Queue the send of one group's `grads` to local rank `owner`, first waiting for
        the oldest while `MAX_REDUCES_IN_FLIGHT` are queued."""
        self._settle(keep=MAX_REDUCES_IN_FLIGHT - 1)
        held = 0 if self._keeps(params[0]) else sum(g.numel() * g.element_size()
                                                    for g in grads)
        job = self._sender.submit(self._send, params[0], grads, owner)
        self._jobs.append((job, params, held))
        self._reduced.update(params)
        return job

    def _settle(self, *, keep: int) -> None:
        """Wait for the oldest sends until at most `keep` are queued, raising the first
        one's error."""
        while len(self._jobs) > keep:
            job, _, _ = self._jobs[0]
            try:
                job.result()
            finally:
                del self._jobs[0]

    def held_grad_bytes(self) -> int:
        """Bytes this reducer holds now beside the kept `.grad`s: the gradients of the
        queued sends of groups it does not keep, and its piece buffers."""
        buffers = [self._bucket] + (self._chunks or [])
        return sum(held for job, _, held in self._jobs if not job.done()) + sum(
            b.numel() * b.element_size() for b in buffers if b is not None)

    def _send(self, first: nn.Parameter, grads: list[torch.Tensor], owner: int) -> None:
        """On the sender thread: one group's gradients (`first`: one of its parameters),
        piece by piece, reduced to local rank `owner` and, across nodes, on from there:
        in place, or through the bucket (and back out where this rank keeps the sum)."""
        if self._failed is not None:
            raise self._failed
        try:
            keep = self._keeps(first)
            dst = self._layout.node_ranks[owner]
            for part in pieces(grads, REDUCE_PIECE_NUMEL):
                piece = self._piece(part)
                self._wait(dist.reduce(piece, dst=dst, op=dist.ReduceOp.SUM,
                                       group=self._layout.intra, async_op=True))
                if owner == self._rank and self._layout.nodes > 1:
                    self._cross(piece, first)
                if keep and piece is not part:
                    part.copy_(piece)
        except BaseException as err:
            self._failed = err
            raise

    def _piece(self, part: torch.Tensor) -> torch.Tensor:
        """What one collective sends of `part`: itself where it is fp32 on the reduce's
        device (in place), else its copy in the bucket."""
        if part.dtype == torch.float32 and part.device == self._backend_device:
            return part
        if self._bucket is None or self._bucket.numel() < part.numel():
            self._bucket = torch.empty(part.numel(), dtype=torch.float32,
                                       device=self._backend_device)
        return self._bucket[:part.numel()].copy_(part)

    def _cross(self, piece: torch.Tensor, first: nn.Parameter) -> None:
        """The second stage of a piece this rank owns, once reduced within the node:
        all-reduced among the share's owners on every node (replicated), or gathered to
        the node that updates its group, which adds the others' into its own in node
        order (split). Each node sends (K - 1) / K of the gradients there, as the model's
        reduce-scatter. (gloo's `reduce` reduce-scatters, then gathers to the root, so
        the root sends half of every buffer too; its point-to-point sends and receives
        never fail when their peer dies, where a collective does.)"""
        layout = self._layout
        if self._node_of is None:
            self._wait(dist.all_reduce(piece, op=dist.ReduceOp.SUM, group=layout.cross,
                                       async_op=True))
            return
        node = self._node_of[first]
        here = node == layout.node
        if here and (self._chunks is None or self._chunks[0].numel() < piece.numel()):
            self._chunks = [torch.empty(piece.numel(), dtype=torch.float32,
                                        device=self._backend_device)
                            for _ in range(layout.nodes)]
        chunks = [c[:piece.numel()] for c in self._chunks] if here else None
        self._wait(dist.gather(piece, chunks, dst=layout.cross_ranks[node],
                               group=layout.cross, async_op=True))
        for n, chunk in enumerate(chunks or ()):
            if n != node:
                piece.add_(chunk)

    def _wait(self, work: dist.Work) -> None:
        self._peers.wait_work(work)

    def finish(self) -> None:
        """Reduce what the hooks did not cover (residents), wait; owners take the mean
        as `.grad` and re-measure the engine's norms; the others hold no gradients."""
        groups_rest = [p for g in self._groups for p in g
                       if p.grad is not None and p not in self._reduced]
        self._launch(groups_rest)
        self._settle(keep=0)  # their errors, named (`_wait`)
        for work, flat, params in self._everyone:
            self._wait(work)
            write_mean_grads(flat, params, self._world_size)
            self._engine.refresh_grad_sq_norms(params)
        kept = [p for p in self._kept if p.grad is not None]
        for p in kept:
            p.grad.div_(self._world_size)
        self._engine.refresh_grad_sq_norms(kept)
        self._everyone.clear()
        self._kept.clear()
        self._bucket = self._chunks = None  # (made again at the next step's first piece)
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
