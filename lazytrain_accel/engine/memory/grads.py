"""Gradient offload: device grads -> host fp32 `.grad`, accumulated, norms kept as they land.

A layer's weight gradients leave the device as soon as its backward ends. With an async
backend (CUDA, or its CPU emulation) they are copied on the D2H side stream into one of two
pinned staging buffers and folded into the host `.grad` once the copy is done (at the
next layer's backward, or at the end of the backward pass); on CPU they are folded in at
once. Each fold also records the squared L2 norm of the accumulated gradient, so clipping
after the last micro-batch needs no pass. A taker (a split update's reduce) may take a
layer's landed gradients instead of the fold: they never become `.grad`, and a staging
buffer it reads is reused only once it is done with it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import nn

from lazytrain_accel.engine.device.streams import Event, Streams
from lazytrain_accel.engine.memory.grad_files import NvmeGrads
from lazytrain_accel.engine.stats import Accounting


class GradSink:
    def __init__(self, *, streams: Streams, accounting: Accounting, max_numel: int,
                 grad_dtype: torch.dtype) -> None:
        self._streams = streams
        self._acct = accounting
        self.sq_norms: dict[nn.Parameter, float] = {}
        # Called with a layer's params once their grads are accumulated on the host
        # (data parallelism starts that layer's all-reduce there).
        self.ready_hooks: list[Callable[[list[nn.Parameter]], None]] = []
        #: Called with a layer's params and landed grads before they are folded: a Future
        #: (done once it no longer reads the grads) when it takes them instead of `.grad`,
        #: None to leave them to the fold (`grad_reduce.ShareReducer.take`).
        self.taker: Callable[[list[nn.Parameter], list[torch.Tensor]],
                             Future[None] | None] | None = None
        # staging slot -> the taker still reading what landed there
        self._taken: dict[int, Future[None]] = {}
        #: The files of the layers whose gradients the plan homes on NVMe: a layer's
        #: folded `.grad` goes there once its norms are recorded (`grad_files.py`).
        self.files: NvmeGrads | None = None
        self._staging = [streams.empty_host(torch.Size([max_numel]), grad_dtype)
                         for _ in range(2)] if streams.is_async else []
        self._pending: list[tuple[int, list[nn.Parameter], Event | None]] = []
        # Each parameter's host `.grad` storage, made at its first fold and reused every
        # step (`owned_grad`).
        self._grads: dict[nn.Parameter, torch.Tensor] = {}
        self._next = 0
        self._staging_bytes = 2 * max_numel * torch.empty(0, dtype=grad_dtype).element_size()
        if self._staging:
            accounting.allocate("host_pinned", self._staging_bytes)

    def put(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """Take `grads` (device, compute dtype) of `params` (already back on their masters)."""
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        if not self._streams.is_async:
            with self._acct.timed_transfer("grads_d2h", nbytes):
                self.fold(params, grads, owned=True)
            return
        slot = self._next
        self._next = 1 - self._next
        self._drain(slot)  # the host has read this staging's previous contents
        if (taken := self._taken.pop(slot, None)) is not None:
            with self._acct.stalled():
                taken.result()  # and so has a taker (its error raised here)
        streams, staging, offset = self._streams, self._staging[slot], 0
        streams.claim(staging)
        with streams.copy_stream("d2h"), self._acct.timed_transfer("grads_d2h", nbytes):
            for g in grads:
                streams.copy_(staging[offset:offset + g.numel()].view(g.shape), g)
                streams.keep_alive(g)
                offset += g.numel()
            self._pending.append((slot, params, streams.record()))
        if self.taker is not None:
            self._fold_landed(keep=slot)

    def _fold_landed(self, *, keep: int) -> None:
        """Fold now the pending copies (but slot `keep`'s) that have completed, without
        waiting: a taker's send of them has until their slot is reused, a layer later."""
        for slot, _, event in list(self._pending):
            if slot != keep and (event is None or event.query()):
                self._drain(slot)

    def drain(self) -> None:
        """Fold every pending copy into the host gradients (end of a backward pass)."""
        while self._pending:
            self._drain(self._pending[0][0])

    def _drain(self, slot: int) -> None:
        for k, (pending_slot, params, event) in enumerate(self._pending):
            if pending_slot != slot:
                continue
            with self._acct.stalled():
                self._streams.host_waits(event)
            staging, offset, grads = self._staging[slot], 0, []
            for p in params:
                grads.append(staging[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            nbytes = offset * staging.element_size()
            with self._acct.host_work("grads_fold", nbytes):
                if (taken := self.fold(params, grads, owned=False)) is not None:
                    self._taken[slot] = taken
            del self._pending[k]
            return

    def fold(self, params: list[nn.Parameter], grads: list[torch.Tensor], *,
              owned: bool) -> Future[None] | None:
        """Accumulate; `owned` grads are fresh autograd outputs that may become `.grad`.
        Returns the taker's Future where it took them instead."""
        if not params:
            return None
        layer = self.files.layer_of(params) if self.files is not None else None
        if self.taker is not None and layer is None \
                and (taken := self.taker(params, grads)) is not None:
            return taken
        if layer is not None:  # into the buffer its file is written from
            self.files.fold(layer, params, grads)
        else:
            for p, g in zip(params, grads, strict=True):
                if p.grad is not None:
                    p.grad.add_(g.to(p.device))
                elif owned and g.dtype == p.dtype and g.device == p.device:
                    p.grad = g
                else:  # a staging view or a cast: `.grad` needs its own storage
                    p.grad = self.owned_grad(p).copy_(g)
        self.record_norms(params)
        for hook in self.ready_hooks:
            hook(params)
        if layer is not None:
            self.files.spill(layer)
        return None

    def owned_grad(self, p: nn.Parameter) -> torch.Tensor:
        """`p`'s host gradient storage, allocated once and reused each step after the
        optimizer's `zero_grad(set_to_none=True)` dropped `.grad` (the update of a layer
        is done before its next backward folds into it). A fresh tensor each step would
        fault in every page of the model's fp32 gradients on first touch, on the training
        thread; the planner counts these bytes as host memory held all step anyway
        (`planning/host.py` `GRAD_TERM`)."""
        grad = self._grads.get(p)
        if grad is None:
            grad = self._grads[p] = torch.empty_like(p, memory_format=torch.contiguous_format)
        return grad

    def kept_bytes(self) -> int:
        """Bytes of the `.grad` storage kept across steps (`owned_grad`)."""
        return sum(g.numel() * g.element_size() for g in self._grads.values())

    def release(self, params: list[nn.Parameter]) -> None:
        """Drop the `.grad` of `params` and their kept storage (`owned_grad`)."""
        for p in params:
            p.grad = None
            self._grads.pop(p, None)

    def record_norms(self, params: list[nn.Parameter]) -> None:
        """Remember the squared norm of each parameter's current `.grad`."""
        if not params:
            return
        norms = torch._foreach_norm([p.grad for p in params])
        for p, sq in zip(params, torch.stack(norms).square().tolist(), strict=True):
            self.sq_norms[p] = sq

    def close(self) -> None:
        self.drain()
        if self.files is not None:
            self.files.close()
        if self._staging:
            self._acct.free("host_pinned", self._staging_bytes)
        self._staging = []
        self._taken.clear()  # the reduce has ended: `ShareReducer.finish`
        self._grads.clear()
