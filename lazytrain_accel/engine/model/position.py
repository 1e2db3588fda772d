"""`LayerPosition`: what one layer call of a forward pass keeps for its backward.

A leaf shared by `layer_call.py` (which records positions) and `runtime.py` (which re-runs
a layer from one), so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils import _pytree as pytree

from lazytrain_accel.engine.model.captures import Captured
from lazytrain_accel.engine.model.replay import ReplayState


@dataclass(kw_only=True)
class LayerPosition:
    """One decoder-layer call of a forward pass, as its backward needs it again."""

    layer: int  # 1-based index of the decoder layer run at this position
    leaves: list[Any]  # flattened call kwargs (tensors referenced, never copied)
    spec: pytree.TreeSpec
    extra_ids: list[int]  # kwargs leaves that require grad (they get gradients too)
    hidden_requires_grad: bool
    replay: ReplayState
    tile_tokens: int  # the plan's when the forward ran; its backward re-run tiles the same
    attention_block_tokens: int  # likewise, the plan's query blocks (0: whole sequence)
    layer_tiled: bool = False  # its forward ran the whole layer in sequence tiles
    tile_replays: list[ReplayState] = field(default_factory=list)  # each tile's RNG state
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)  # non-tensor outputs, by slot
    tensor_ids: list[int] = field(default_factory=list)  # output leaves that are tensors
    captured: Captured | None = None  # tensors the layer gave transformers' collector
