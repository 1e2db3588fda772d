"""Packed frozen weights (bitsandbytes `Params4bit`, `Int8Params`): streamed as stored.

A QLoRA base keeps its linear weights packed (4-bit: two weights per uint8, plus a
`QuantState` of absmax scales; LLM.int8: int8 plus per-row `SCB` scales). They are never
cast to a float master nor copied into the compute-dtype slot of `weights.WeightPool`
(that cast would turn packed bytes into numbers): `PackedWeightPool` streams the float
parameters through the pool as before, and for the packed ones moves the stored bytes and
their scales to the device while the layer runs, so bitsandbytes' own modules compute
with them there. Nothing is dequantized here.

On a CPU device the packed host tensors already are the device copy: they are used in
place. That also keeps bitsandbytes' CPU repacking (`_convert_weight_packed_for_cpu`, an
eval-mode forward rewrites `param.data` and flags its `QuantState`) on the real parameter,
as in a stock run, instead of on a temporary copy the engine would then throw away.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lazytrain_accel.engine.weights import WeightPool

#: Parameter classes whose data is packed (bitsandbytes), recognised by name so that
#: bitsandbytes is imported only by models that use it.
PACKED_CLASSES = ("Params4bit", "Int8Params")


def is_packed(p: torch.Tensor) -> bool:
    """Whether `p` holds packed integer weights (never a float master, never cast)."""
    return not p.is_floating_point() and (type(p).__name__ in PACKED_CLASSES
                                          or p.dtype in (torch.uint8, torch.int8))


def _state_to(state: Any, device: torch.device) -> Any:
    """A copy of a bitsandbytes `QuantState` on `device` (the original stays where it is:
    `QuantState.to` moves in place, so it runs on a shallow copy, nested state included)."""
    moved = copy.copy(state)
    nested = getattr(state, "state2", None)
    if nested is not None:
        moved.state2 = copy.copy(nested)
    moved.to(device)
    return moved


def packed_to(p: nn.Parameter, device: torch.device) -> dict[str, Any]:
    """Point packed `p` (data, `quant_state`, `SCB`) at copies on `device`; returns what
    `restore` needs to point it back."""
    saved = {"data": p.data}
    p.data = p.data.to(device, non_blocking=True)
    for name in ("quant_state", "SCB"):
        value = getattr(p, name, None)
        if value is None:
            continue
        saved[name] = value
        setattr(p, name, value.to(device, non_blocking=True) if isinstance(value, torch.Tensor)
                else _state_to(value, device))
    return saved


def restore(p: nn.Parameter, saved: dict[str, Any]) -> None:
    p.data = saved.pop("data")
    for name, value in saved.items():
        setattr(p, name, value)


def packed_to_host(p: nn.Parameter) -> None:
    """Move a packed parameter loaded on an accelerator to the host, scales included."""
    if p.device.type != "cpu":
        packed_to(p, torch.device("cpu"))


class PackedWeightPool(WeightPool):
    """`WeightPool` for the float parameters, plus packed ones streamed as stored."""

    def __init__(self, layer_params: list[list[nn.Parameter]], **kwargs: Any) -> None:
        self._packed = [[p for p in ps if is_packed(p)] for ps in layer_params]
        super().__init__([[p for p in ps if not is_packed(p)] for ps in layer_params],
                         **kwargs)
        self._in_place = self._streams.device.type == "cpu"
        self._saved: dict[int, list[dict[str, Any]]] = {}

    def acquire(self, layer: int) -> None:
        super().acquire(layer)
        if self._in_place:
            return
        packed = self._packed[layer - 1]
        nbytes = sum(p.numel() * p.element_size() for p in packed)
        with self._acct.timed_transfer("weights_h2d", nbytes):
            self._saved[layer] = [packed_to(p, self._streams.device) for p in packed]

    def release(self, layer: int) -> None:
        for p, saved in zip(self._packed[layer - 1], self._saved.pop(layer, []), strict=False):
            restore(p, saved)
        super().release(layer)


def weight_pool(layer_params: list[list[nn.Parameter]], **kwargs: Any) -> WeightPool:
    """The engine's weight pool: `PackedWeightPool` when a layer holds packed weights."""
    if any(is_packed(p) for ps in layer_params for p in ps):
        return PackedWeightPool(layer_params, **kwargs)
    return WeightPool(layer_params, **kwargs)
