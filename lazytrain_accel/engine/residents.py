"""Resident parameters (embeddings, final norm, head, ...): device copies during a pass.

Their masters stay on the host like every other parameter. While a pass uses them,
`param.data` is a compute-dtype device copy and `.grad` accumulates on the device;
when no forward awaits its backward any more, the device gradient is folded into the
host `.grad` (stashed while the copy was in) and `param.data` returns to the master.
When the device copy would be the master itself (device = CPU, compute dtype = fp32) the
parameters are used in place and autograd accumulates `.grad` directly; only the norms
are recorded at the end of the backward (copying 100 MB embeddings to an identical buffer
and back costs ~5% of a CPU step for nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from lazytrain_accel.engine.grads import GradSink
from lazytrain_accel.engine.stats import Accounting


class ResidentParams:
    def __init__(self, params: list[nn.Parameter], *, device: torch.device,
                 compute_dtype: torch.dtype, sink: GradSink, accounting: Accounting) -> None:
        self.params = params
        self._device = device
        self._dtype = compute_dtype
        self._sink = sink
        self._acct = accounting
        self._masters: list[torch.Tensor] = []
        self._stash: list[torch.Tensor | None] = []
        self._in_place = device.type == "cpu" and compute_dtype == torch.float32
        self.active = False

    def swap_in(self) -> None:
        """Point every resident parameter at a fresh device copy of its master."""
        if self.active:
            return
        self.active = True
        if self._in_place:
            return
        self._masters = [p.data for p in self.params]
        self._stash = [p.grad for p in self.params]
        nbytes = 0
        for p in self.params:
            p.grad = None
            dtype = self._dtype if p.is_floating_point() else p.dtype
            p.data = p.data.to(device=self._device, dtype=dtype, copy=True)
            nbytes += p.numel() * p.element_size()
        self._acct.allocate("device", nbytes)
        self._nbytes = nbytes

    def swap_out(self) -> None:
        """Fold device gradients into the host `.grad` and point back at the masters."""
        if not self.active:
            return
        self.active = False
        if self._in_place:
            self._sink.record_norms([p for p in self.params if p.grad is not None])
            return
        folded, grads = [], []
        for p, master, stash in zip(self.params, self._masters, self._stash, strict=True):
            grad = p.grad
            p.grad = None
            p.data = master
            p.grad = stash
            if grad is not None:
                folded.append(p)
                grads.append(grad)
        self._sink.fold(folded, grads, owned=False)
        self._acct.free("device", self._nbytes)
        self._masters, self._stash = [], []
