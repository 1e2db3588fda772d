"""Resident parameters (embeddings, final norm, head, ...): device copies during a pass.

Their masters stay on the host. While a pass uses them, `param.data` is a compute-dtype
device copy and `.grad` accumulates on the device; once no forward awaits its backward,
the device gradient is folded into the host `.grad` and `param.data` returns to the
master. The input side is swapped in when the model's forward starts, the output side
(final norm, untied head) only when its first module runs (`swap_in_late`), so the
layer-wise update may still write its masters while the layers run. Where the copy would
be the master itself (fp32 on the CPU) the parameter is used in place. With
`Plan.resident_update="device"` the trainable masters live on the device (`device_masters`).
Docs: docs/engine.md "Execution model" (**Residents**).
"""

from __future__ import annotations

import torch
from torch import nn

from lazytrain_accel.engine.memory.grads import GradSink
from lazytrain_accel.engine.stats import Accounting


class ResidentParams:
    def __init__(self, params: list[nn.Parameter], *, late: list[nn.Parameter],
                 device: torch.device, compute_dtype: torch.dtype, sink: GradSink,
                 accounting: Accounting, device_masters: bool = False) -> None:
        late_ids = {id(p) for p in late}
        self.early = [p for p in params if id(p) not in late_ids]  # input side
        self.late = [p for p in params if id(p) in late_ids]  # output side
        self.params = self.early + self.late
        self._device = device
        self._dtype = compute_dtype
        self._sink = sink
        self._acct = accounting
        self._swapped: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = []
        self._direct: list[nn.Parameter] = []  # used in place this pass
        self._nbytes = 0
        self.active = False
        self._late_in = False
        #: Trainable residents whose fp32 masters live on the device (resident_update
        #: "device"); the others' masters stay on the host.
        self.on_device = [p for p in self.params if device_masters and p.requires_grad
                          and p.is_floating_point()]
        self._on_device_ids = {id(p) for p in self.on_device}
        self._master_bytes = 0
        if device.type != "cpu":
            for p in self.on_device:
                p.data = p.data.to(device)
                self._master_bytes += p.numel() * p.element_size()
            accounting.allocate("device", self._master_bytes)

    def _in_place(self, p: nn.Parameter) -> bool:
        """Whether the master already is the device copy a pass needs."""
        if self._device.type == "cpu":
            return self._dtype == torch.float32
        return id(p) in self._on_device_ids and p.dtype == self._dtype

    def swap_in(self) -> None:
        """Point the input side's parameters at fresh device copies of their masters."""
        if self.active:
            return
        self.active, self._late_in = True, False
        self._swap(self.early)

    def swap_in_late(self) -> None:
        """Likewise for the output side, once per pass (its first module is about to run)."""
        if self.active and not self._late_in:
            self._late_in = True
            self._swap(self.late)

    def _swap(self, params: list[nn.Parameter]) -> None:
        nbytes = 0
        for p in params:
            if self._in_place(p):
                self._direct.append(p)
                continue
            self._swapped.append((p, p.data, p.grad))
            p.grad = None
            dtype = self._dtype if p.is_floating_point() else p.dtype
            p.data = p.data.to(device=self._device, dtype=dtype, copy=True)
            nbytes += p.numel() * p.element_size()
        self._acct.allocate("device", nbytes)
        self._nbytes += nbytes

    def swap_out(self) -> None:
        """Fold device gradients into the host `.grad` and point back at the masters."""
        if not self.active:
            return
        self.active = False
        direct, self._direct = self._direct, []
        self._sink.record_norms([p for p in direct if p.grad is not None])
        folded, grads = [], []
        for p, master, stash in self._swapped:
            grad = p.grad
            p.grad = None
            p.data = master
            p.grad = stash
            if grad is not None:
                folded.append(p)
                grads.append(grad)
        self._sink.fold(folded, grads, owned=False)
        self._acct.free("device", self._nbytes)
        self._swapped, self._nbytes = [], 0

    def masters_to_host(self) -> None:
        """Move device masters (and their gradients) back to the host (detach)."""
        for p in self.on_device:
            p.data = p.data.to("cpu")
            if p.grad is not None:
                p.grad = p.grad.to("cpu")
        self._acct.free("device", self._master_bytes)
        self.on_device, self._on_device_ids, self._master_bytes = [], set(), 0


def update_groups(model: nn.Module, stack: nn.Module, layers_attr: str,
                  layers: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Every parameter of `model` by update group, in update order: the input-side
    residents, each decoder layer's parameters, the output-side residents (`output_side`).
    The engine's groups (`StepCoordinator.update_groups`), and the node store's placement
    by owner before the engine exists (`run/node_layout.py`)."""
    layer_params = [list(layer.parameters()) for layer in layers]
    in_layers = {id(p) for ps in layer_params for p in ps}
    resident = [p for p in model.parameters() if id(p) not in in_layers]
    late = {id(p) for p in output_side(model, stack, layers_attr, resident)}
    return [[p for p in resident if id(p) not in late], *layer_params,
            [p for p in resident if id(p) in late]]


def output_side(model: nn.Module, stack: nn.Module, layers_attr: str,
                params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Of the resident `params`, those the forward reads only after the decoder layers:
    the untied output head and the decoder stack's modules registered after its layers
    (the final norm). A weight tied to the input embeddings is input side. (A module
    misjudged here is still safe: the engine waits for the output side's update when
    any of its modules is called.)"""
    names = list(stack._modules)
    modules = [m for name in names[names.index(layers_attr) + 1:]
               if (m := stack._modules[name]) is not None]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Module):
        modules.append(head)
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    inputs = {id(p) for p in embeddings.parameters()} if isinstance(embeddings,
                                                                     nn.Module) else set()
    late = {id(p) for m in modules for p in m.parameters()} - inputs
    return [p for p in params if id(p) in late]


def owners(model: nn.Module, params: list[nn.Parameter]) -> list[nn.Module]:
    """The modules that hold any of `params` directly."""
    ids = {id(p) for p in params}
    return [m for m in model.modules()
            if any(id(p) in ids for p in m.parameters(recurse=False))]
