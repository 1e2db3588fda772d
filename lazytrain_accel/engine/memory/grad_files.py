"""The gradients of the layers whose gradients the plan homes on NVMe (`Plan.state.grads`):
written to a file once the backward has folded a layer's gradients into its `.grad` and
recorded their norms, read back for that layer's update (issued ahead, through
`STATE_STAGING_GROUPS` buffers: the planner's count) and dropped when it is done.

Between the backward and the update such a layer's parameters have `.grad` None (the
engine keeps their norms for the clip). An applied update consumes them, as DeepSpeed's
offloaded gradients: the next backward starts that layer from none, as after
`zero_grad(set_to_none=True)`; a skipped step and a `zero_grad()` of the model or the
optimizer drop them too. A second micro-batch of one step reads the file back, adds, and
writes it again. Files go through the engine's `StateIO` as `LayerFiles`
(`layer_files.py`) into `<NVMe directory>/state`; a failed write or read raises its
`StateIOError` at the next use.
Docs: docs/engine.md "Host state on NVMe".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from lazytrain_accel.engine.memory.layer_files import LayerFiles
from lazytrain_accel.engine.memory.state_io import StateIO
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.planning.state import STATE_STAGING_GROUPS
from lazytrain_accel.storage.direct_io import aligned_empty
from lazytrain_accel.storage.flat import flat_views


class NvmeGrads:
    """Files of the gradients of `layers` (1-based) under `directories` (one per drive);
    `params[j - 1]` are layer j's trainable parameters, in the order the engine folds them."""

    def __init__(self, directories: Sequence[Path], layers: set[int],
                 params: list[list[nn.Parameter]], accounting: Accounting, io: StateIO, *,
                 claim_root: Callable[[], None]) -> None:
        self.layers = frozenset(layers)
        self._files = LayerFiles(directories, "grad", accounting, io, claim_root=claim_root)
        self._params = params
        self._acct = accounting
        #: parameter -> (its layer, its place among the layer's parameters)
        self._place = {p: (j, k) for j, ps in enumerate(params, start=1)
                       for k, p in enumerate(ps)}
        #: layer -> which of its parameters have a gradient in its file (this step's)
        self._held: dict[int, list[bool]] = {}
        self._free: list[torch.Tensor] = []  # staging buffers, fp32, the largest layer's size
        self._buffers = 0
        #: the update's layers still to read, in its order; the reads issued, by layer
        self._queue: deque[int] = deque()
        self._reads: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self._staged: dict[int, torch.Tensor] = {}
        self._layer_numel = [sum(p.numel() for p in ps) for ps in params]
        self._buffer_numel = max(self._layer_numel, default=0)
        #: layer -> the aligned buffer its `.grad` are views of, between `fold` and `spill`
        self._open: dict[int, torch.Tensor] = {}

    # ---- what the engine asks -------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether some layer's gradients of this step live in a file now."""
        return bool(self._held)

    def holds(self, param: nn.Parameter) -> bool:
        """Whether `param`'s gradient of this step lives in its layer's file."""
        layer, k = self._place.get(param, (None, 0))
        has = self._held.get(layer) if layer is not None else None
        return has is not None and has[k]

    def layer_of(self, params: Sequence[nn.Parameter]) -> int | None:
        """The NVMe-homed layer whose parameters `params` are, else None."""
        layer = self._place[params[0]][0] if params and params[0] in self._place else None
        return layer if layer in self.layers else None

    # ---- the backward ----------------------------------------------------------------
    def fold(self, layer: int, params: Sequence[nn.Parameter],
             grads: Sequence[torch.Tensor]) -> None:
        """Accumulate `grads` of `params` (layer `layer`'s) into their `.grad`, which are
        views of one aligned buffer of the layer's, its earlier micro-batch's gradients
        read back into it first: `spill` writes that buffer whole, without a bounce
        buffer's copy (`direct_io`)."""
        buffer = self._open[layer] = self.restore(layer)
        views = dict(zip(self._params[layer - 1], self._views(buffer, layer), strict=True))
        for p, g in zip(params, grads, strict=True):
            if p.grad is not None:
                p.grad.add_(g.to(p.device))
            else:
                p.grad = views[p].copy_(g)

    def restore(self, layer: int) -> torch.Tensor:
        """An aligned buffer of layer `layer`'s gradients, its parameters' `.grad` views of
        it: those of an earlier micro-batch of this step read back into it (now, on this
        thread), the others' slots unset."""
        buffer = aligned_empty(self._layer_numel[layer - 1], torch.float32)
        has = self._held.pop(layer, None)
        if has is not None:
            self._read(layer, [buffer]).result()
            for p, held, view in zip(self._params[layer - 1], has, self._views(buffer, layer),
                                     strict=True):
                if held:
                    p.grad = view
        return buffer

    def spill(self, layer: int) -> None:
        """Write layer `layer`'s `.grad` (folded, its norms recorded) to its file behind
        and drop it from the parameters."""
        params = self._params[layer - 1]
        has = [p.grad is not None for p in params]
        buffer = self._open.pop(layer)
        if not any(has):
            return
        for p, view in zip(params, self._views(buffer, layer), strict=True):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # a `.grad` set outside the fold (a re-plan's layer)
        write = self._files.write(layer, [buffer])
        kept = [buffer]
        write.add_done_callback(lambda _: kept.clear())  # written: its DRAM is free
        self._held[layer] = has
        for p in params:
            p.grad = None

    # ---- the update ------------------------------------------------------------------
    def begin_update(self, order: Sequence[int]) -> None:
        """The update is about to run groups `order`: start reading the first ones' files."""
        self._queue = deque(j for j in order if j in self._held)
        self._read_ahead()

    def stage(self, layer: int) -> None:
        """Point layer `layer`'s parameters' `.grad` at its gradients, read from its file
        (waited for here); nothing for a layer whose gradients are not in a file."""
        if layer not in self._held:
            return
        if layer not in self._reads:  # not read ahead (out of the update's order): now
            if layer in self._queue:
                self._queue.remove(layer)
            self._issue(layer)
        buffer, read = self._reads.pop(layer)
        has = self._held.pop(layer)
        self._staged[layer] = buffer
        read.result()
        for p, held, view in zip(self._params[layer - 1], has, self._views(buffer, layer),
                                 strict=True):
            if held:
                p.grad = view

    def unstage(self, layer: int) -> None:
        """Layer `layer`'s update is done: drop its gradients, reuse its buffer."""
        buffer = self._staged.pop(layer, None)
        if buffer is None:
            return
        for p in self._params[layer - 1]:
            p.grad = None
        self._free.append(buffer)
        self._read_ahead()

    def end_update(self) -> None:
        """The update ended (done, or failed part way): no read stays in flight, every
        buffer is back."""
        self._queue.clear()
        for layer in list(self._reads):
            buffer, read = self._reads.pop(layer)
            read.exception()  # waited for; its error belongs to the step that failed
            self._free.append(buffer)
        for layer in list(self._staged):
            self.unstage(layer)

    def discard(self) -> None:
        """Forget this step's gradients (a skipped step, a `zero_grad()`)."""
        self.end_update()
        self._held.clear()
        self._open.clear()

    def set_layers(self, layers: set[int]) -> None:
        """A re-plan homes `layers`' gradients on NVMe from now: those of this step living
        in the file of a layer no longer homed there come back to `.grad`."""
        for layer in sorted(set(self._held) - layers):
            self.restore(layer)  # `.grad` views of the buffer, which they keep alive
        self.layers = frozenset(layers)

    # ---- files and buffers -----------------------------------------------------------
    def wait_written(self, layer: int) -> None:
        """Block until layer `layer`'s last write is on the drive; raise its error."""
        self._files.wait_written(layer)

    def close(self) -> None:
        """Wait for every write and read, remove the files, free the buffers (the engine
        closes its `StateIO`)."""
        self.end_update()
        self._held.clear()
        self._open.clear()
        if self._buffers:
            self._acct.free("host_pageable", self._buffers * self._buffer_numel * 4)
        self._free, self._buffers = [], 0
        self._files.close()

    def _read(self, layer: int, tensors: list[torch.Tensor]) -> Future[None]:
        return self._files.read(layer, tensors)

    def _read_ahead(self) -> None:
        while self._queue and (self._free or self._buffers < STATE_STAGING_GROUPS):
            self._issue(self._queue.popleft())

    def _issue(self, layer: int) -> None:
        if not self._free:
            # aligned: the file's reads land in it without a bounce buffer's copy
            self._free.append(aligned_empty(self._buffer_numel, torch.float32))
            self._buffers += 1
            self._acct.allocate("host_pageable", self._buffer_numel * 4)
        buffer = self._free.pop()
        self._reads[layer] = (buffer, self._read(layer, [buffer[:self._layer_numel[layer - 1]]]))

    def _views(self, buffer: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s parameters' slots in `buffer`: its file's layout (every
        parameter's, those without a gradient this step left unset)."""
        return flat_views(buffer, self._params[layer - 1])
