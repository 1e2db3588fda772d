"""Tensors laid out back to back in one flat buffer: the layout of a layer's slot, its
staging and its state files (`engine/memory/`), timed as such at `prepare`
(`profiling/layer_timing.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flat_views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` (1-D, of the dtype wanted) shaped like `tensors`, one after the
    other from its start."""
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views
