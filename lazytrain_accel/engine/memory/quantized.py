"""Packed frozen weights (bitsandbytes `Params4bit`, `Int8Params`): streamed as stored.

A QLoRA base's packed linear weights are never cast to a float master nor copied into the
compute-dtype slot of `weights.WeightPool` (the cast would turn packed bytes into
numbers): `PackedWeightPool` streams the float parameters as before and moves the packed
bytes and their scales to the device beside them, staged and ordered like the float copy,
so bitsandbytes' own modules compute with them there. Nothing is dequantized here. On a
synchronous CPU device the packed host tensors are used in place, so bitsandbytes'
eval-mode CPU repack happens on the real parameter as in a stock run; under the emulated
device the pool repacks the host master the same way (`_adopt_cpu_repack`).
Docs: docs/engine.md "Execution model" (**Weights**, "Eval mode").
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lazytrain_accel.engine.device.streams import Event
from lazytrain_accel.engine.memory.weights import WeightPool

#: Parameter classes whose data is packed (bitsandbytes), recognised by name so that
#: bitsandbytes is imported only by models that use it.
PACKED_CLASSES = ("Params4bit", "Int8Params")


def is_packed(p: torch.Tensor) -> bool:
    """Whether `p` holds packed integer weights (never a float master, never cast)."""
    return not p.is_floating_point() and (type(p).__name__ in PACKED_CLASSES
                                          or p.dtype in (torch.uint8, torch.int8))


def forward_follows_grad_mode(layer: nn.Module, device: torch.device) -> bool:
    """Whether `layer`'s forward may compute differently under no_grad than with grad on.

    bitsandbytes' `Linear4bit.forward` (and its LinearNF4/LinearFP4 subclasses), on a CPU
    with AVX512-BF16 and in eval mode, repacks its weight for the CPU inference kernel
    (`_convert_weight_packed_for_cpu`: bf16 math) at a call whose input does not require
    grad, and runs that kernel from then on. Stock, training an eval-mode model, takes it
    only where no grad reaches the input (layer 1's projections when the embeddings are
    frozen); under no_grad every input qualifies."""
    return device.type == "cpu" and any(
        not m.training and getattr(m, "support_avx512bf16_for_cpu", False)
        and any(c.__name__ == "Linear4bit" for c in type(m).__mro__)
        for m in layer.modules())


def _state_to(state: Any, device: torch.device) -> Any:
    """A copy of a bitsandbytes `QuantState` on `device` (the original stays where it is:
    `QuantState.to` moves in place, so it runs on a shallow copy, nested state included)."""
    moved = copy.copy(state)
    nested = getattr(state, "state2", None)
    if nested is not None:
        moved.state2 = copy.copy(nested)
    moved.to(device)
    return moved


def _packed_to(p: nn.Parameter, device: torch.device) -> None:
    """Move packed `p` (data, `quant_state`, `SCB`) to `device`."""
    p.data = p.data.to(device)
    for name in ("quant_state", "SCB"):
        value = getattr(p, name, None)
        if value is not None:
            setattr(p, name, value.to(device) if isinstance(value, torch.Tensor)
                    else _state_to(value, device))
    if getattr(p, "CB", None) is not None:  # Int8Params: CB is its data
        p.CB = p.data


def packed_to_host(p: nn.Parameter) -> None:
    """Move a packed parameter loaded on an accelerator to the host, scales included."""
    if p.device.type != "cpu":
        _packed_to(p, torch.device("cpu"))


#: Byte alignment of each tensor in a packed slot (a float32 view needs 4; CUDA kernels
#: like 128-byte aligned rows, and the allocator gives 512-byte aligned blocks).
ALIGN_BYTES = 256


#: The tensors of a bitsandbytes `QuantState` (and of its nested `state2`) a kernel reads.
_STATE_TENSORS = ("absmax", "code", "offset")


def _host_tensors(p: nn.Parameter) -> dict[str, torch.Tensor]:
    """What a packed `p` computes with, by name: its data and its scales (4-bit: the
    `QuantState`'s absmax, code and nested state; LLM.int8: the per-row `SCB`)."""
    tensors = {"data": p.data}
    state = getattr(p, "quant_state", None)
    for prefix, st in (("", state), ("state2.", getattr(state, "state2", None))):
        for name in _STATE_TENSORS:
            value = getattr(st, name, None) if st is not None else None
            if isinstance(value, torch.Tensor):
                tensors[prefix + name] = value
    if type(p).__name__ == "Int8Params":
        if p.SCB is None:
            raise ValueError("an Int8Params weight has no SCB scales on the parameter: its "
                             "Linear8bitLt ran a forward before prepare and moved them into "
                             "the module's state; prepare the model before running it")
        tensors["SCB"] = p.SCB
    return tensors


def _point_at(p: nn.Parameter, host: dict[str, torch.Tensor], views: dict[str, torch.Tensor],
              state: Any) -> None:
    """Point `p` (and a shallow copy of its `QuantState`) at `views`, tensors like `host`'s.
    An Int8Params gets its `CB`/`SCB` too: bitsandbytes' `Linear8bitLt` re-reads them into
    its module state at each forward (`init_8bit_state`) while `weight.CB` is set."""
    p.data = views["data"]
    if state is not None:
        moved = copy.copy(state)
        for name in _STATE_TENSORS:
            if name in views:
                setattr(moved, name, views[name])
        if getattr(state, "state2", None) is not None:  # bitsandbytes' CPU repack drops it
            moved.state2 = copy.copy(state.state2)
            for name in _STATE_TENSORS:
                if "state2." + name in views:
                    setattr(moved.state2, name, views["state2." + name])
        p.quant_state = moved
    if "SCB" in host:
        p.CB, p.SCB = views["data"], views["SCB"]


def _cpu_packed(state: Any) -> bool:
    """Whether bitsandbytes repacked this `QuantState`'s weight for its CPU kernel."""
    return bool(getattr(state, "packing_format_for_cpu", False))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class PackedWeightPool(WeightPool):
    """`WeightPool` for the float parameters, plus packed ones streamed as stored.

    On an async device (CUDA, or its CPU emulation) each slot of the float pool has a byte
    slot beside it: a layer's packed tensors go host -> pinned staging -> byte slot on the
    same H2D side stream as its float parameters, right after them, so the slot's load
    event covers both; staging is claimed and waited for, the slot's last reader waited
    for, exactly as the float copy does. The prefetch of layer j+1 loads its packed bytes.
    On a synchronous CPU device they are used in place (see the module docstring)."""

    def __init__(self, layer_params: list[list[nn.Parameter]], **kwargs: Any) -> None:
        self._packed = [[p for p in ps if is_packed(p)] for ps in layer_params]
        self._packed_slots: list[torch.Tensor] = []
        self._packed_staging: list[torch.Tensor] = []
        self._packed_staging_free: list[Event | None] = []
        self._in_place = True  # until the byte slots exist (the base __init__ grows)
        super().__init__([[p for p in ps if not is_packed(p)] for ps in layer_params],
                         **kwargs)
        if not self._streams.is_async:
            return
        # Frozen: the host tensors (and their byte layout) are fixed from here on, but for
        # bitsandbytes' one-time CPU repack (`_adopt_cpu_repack`).
        self._host = [[_host_tensors(p) for p in ps] for ps in self._packed]
        self._states = [[getattr(p, "quant_state", None) for p in ps] for ps in self._packed]
        self._offsets, self._layer_slot_bytes = _layout(self._host)
        self._packed_slot_bytes = max(self._layer_slot_bytes, default=0)
        self._in_place = False
        self._grow_packed()

    def grow(self, num_slots: int) -> None:
        super().grow(num_slots)
        if not self._in_place:
            self._grow_packed()

    def _grow_packed(self) -> None:
        """A byte slot and its pinned staging beside each float slot."""
        nbytes, streams = self._packed_slot_bytes, self._streams
        while len(self._packed_slots) < len(self._slots):
            self._packed_slots.append(torch.empty(nbytes, dtype=torch.uint8,
                                                  device=streams.device))
            self._packed_staging.append(streams.empty_host(torch.Size([nbytes]), torch.uint8))
            self._packed_staging_free.append(None)
            self._acct.allocate("device", nbytes)
            self._acct.allocate("host_pinned", nbytes)

    def _load(self, layer: int) -> int:
        slot = super()._load(layer)
        if not self._in_place:
            self._load_packed(layer, slot)
        return slot

    def _load_packed(self, layer: int, slot: int) -> None:
        streams, staging = self._streams, self._packed_staging[slot]
        host, offsets = self._host[layer - 1], self._offsets[layer - 1]
        end = self._layer_slot_bytes[layer - 1]
        with self._acct.stalled():
            streams.host_waits(self._packed_staging_free[slot])  # its last H2D done
        streams.claim(staging)
        for tensors, starts in zip(host, offsets, strict=True):
            for view, t in zip(_views(staging, tensors, starts), tensors.values(),
                               strict=True):
                view.copy_(t)
        # Same side stream, after the float copy: its event covers the whole slot.
        event = self._copy_to_slot(slot, self._packed_slots[slot][:end], staging[:end],
                                   nbytes=_layer_bytes(host))
        self._packed_staging_free[slot] = event

    def acquire(self, layer: int) -> None:
        super().acquire(layer)
        if self._in_place:
            return
        flat = self._packed_slots[self._acquired[layer][0]]
        for p, host, starts, state in zip(self._packed[layer - 1], self._host[layer - 1],
                                          self._offsets[layer - 1], self._states[layer - 1],
                                          strict=True):
            _point_at(p, host, dict(zip(host, _views(flat, host, starts), strict=True)), state)

    def release(self, layer: int) -> None:
        repacked = []
        if not self._in_place:
            for p, host, state in zip(self._packed[layer - 1], self._host[layer - 1],
                                      self._states[layer - 1], strict=True):
                repacked.append(state is not None and _cpu_packed(p.quant_state)
                                and not _cpu_packed(state))
                p.data = host["data"]
                if state is not None:
                    p.quant_state = state
                if "SCB" in host:
                    p.CB, p.SCB = host["data"], host["SCB"]
        super().release(layer)
        if any(repacked):
            self._adopt_cpu_repack(layer, repacked)

    def _adopt_cpu_repack(self, layer: int, repacked: list[bool]) -> None:
        """bitsandbytes repacked the slot's copy of some of `layer`'s 4-bit weights for its
        CPU inference kernel (eval mode, `forward_follows_grad_mode`): repack their host
        masters as a stock run repacks its weights (then flagged, never again), and lay the
        bytes out anew (data reshaped, absmax now bf16, nested state gone)."""
        from bitsandbytes.functional import _convert_weight_packed_for_cpu

        for k, (p, state) in enumerate(zip(self._packed[layer - 1], self._states[layer - 1],
                                           strict=True)):
            if repacked[k]:
                p.data, p.quant_state = _convert_weight_packed_for_cpu(p.data, state)
                self._host[layer - 1][k] = _host_tensors(p)
        self._offsets, self._layer_slot_bytes = _layout(self._host)
        self._policy.forget(layer)  # its bytes in a slot are laid out the old way
        if max(self._layer_slot_bytes) > self._packed_slot_bytes:
            self._free_packed()
            self._packed_slot_bytes = max(self._layer_slot_bytes)
            self._grow_packed()
            self.invalidate()  # what the other slots held sits in the dropped buffers

    def _free_packed(self) -> None:
        """Drop the byte slots and their staging once no copy uses them any more (a copy
        still reading a freed staging buffer would read memory handed out again)."""
        for event in self._packed_staging_free:
            self._streams.host_waits(event)
        n = len(self._packed_slots) * self._packed_slot_bytes
        self._acct.free("device", n)
        self._acct.free("host_pinned", n)
        self._packed_slots, self._packed_staging, self._packed_staging_free = [], [], []

    def close(self) -> None:
        if not self._in_place:
            self._free_packed()
        super().close()


def _layout(host: list[list[dict[str, torch.Tensor]]]
            ) -> tuple[list[list[list[tuple[int, int]]]], list[int]]:
    """Per layer, per packed parameter, each tensor's (start, end) byte offsets in a slot
    (starts aligned to `ALIGN_BYTES`); and per layer the bytes of slot it fills."""
    layout, sizes = [], []
    for layer in host:
        offset, per_param = 0, []
        for tensors in layer:
            spans = []
            for t in tensors.values():
                spans.append((offset, offset + t.numel() * t.element_size()))
                offset = _aligned(spans[-1][1])
            per_param.append(spans)
        layout.append(per_param)
        sizes.append(offset)
    return layout, sizes


def _views(flat: torch.Tensor, tensors: dict[str, torch.Tensor],
           spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of byte buffer `flat` shaped and typed like `tensors`, at `spans`."""
    return [flat[start:end].view(t.dtype).view(t.shape)
            for t, (start, end) in zip(tensors.values(), spans, strict=True)]


def _layer_bytes(host: list[dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for ts in host for t in ts.values())


def weight_pool(layer_params: list[list[nn.Parameter]], **kwargs: Any) -> WeightPool:
    """The engine's weight pool: `PackedWeightPool` when a layer holds packed weights."""
    if any(is_packed(p) for ps in layer_params for p in ps):
        return PackedWeightPool(layer_params, **kwargs)
    return WeightPool(layer_params, **kwargs)
