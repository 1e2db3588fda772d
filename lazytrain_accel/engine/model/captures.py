"""Tensors a layer hands to transformers' output collector, routed through the layer Function.

Transformers 5 gathers router logits (Mixtral's and Qwen3-MoE's auxiliary loss), attention
weights and hidden states with forward hooks on submodules that append to a per-forward
collector (`transformers.utils.output_capturing._active_collector`). Inside a streamed
layer those hooks fire while the layer runs under no_grad, so what they record carries no
graph: a loss built from it (the router auxiliary loss) would silently give the layers no
gradient. The engine takes what a layer's run appended, returns it from the layer Function
as extra outputs (connected to autograd), and puts those outputs back in the collector;
the backward re-run records the same tensors again, now with grad, to differentiate them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

#: transformers >= 5's module holding the collector behind `output_router_logits` and
#: friends. Looked up, never imported: if transformers has not loaded it, no collector can
#: be active (and importing the engine stays free of transformers).
_CAPTURING_MODULE = "transformers.utils.output_capturing"


def _collector_var() -> Any:
    module = sys.modules.get(_CAPTURING_MODULE)
    return getattr(module, "_active_collector", None)


@dataclass(kw_only=True, frozen=True)
class Captured:
    """Where one layer run's tensors went in the collector (never the tensors: they become
    the Function's outputs, whose graph holds this record; holding them would be a cycle
    through the C++ graph that Python's GC cannot see)."""

    prior: dict[str, int]  # each list's length before the run (hooks may branch on it)
    slots: list[tuple[str, int]]  # where each captured tensor sits, in output order


@dataclass(kw_only=True)
class Capture:
    """Filled when a `capturing` block ends: the record and the tensors it found."""

    record: Captured | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)


def _collector() -> dict[str, Any] | None:
    var = _collector_var()
    return None if var is None else var.get()


@contextmanager
def capturing(hidden: torch.Tensor) -> Iterator[Capture]:
    """Run the body with the live collector; yield a `Capture` that then holds what it
    appended (tensors other than `hidden`), for `restore` to replace with connected ones."""
    out = Capture()
    collector = _collector()
    prior = {k: len(v) for k, v in (collector or {}).items() if isinstance(v, list)}
    yield out
    slots, tensors = [], []
    for key, start in prior.items():
        for slot in range(start, len(collector[key])):
            value = collector[key][slot]
            if isinstance(value, torch.Tensor) and value is not hidden:
                slots.append((key, slot))
                tensors.append(value)
    out.record, out.tensors = Captured(prior=prior, slots=slots), tensors


def restore(captured: Captured, tensors: list[torch.Tensor]) -> None:
    """Put the layer Function's outputs in the collector slots their originals held."""
    collector = _collector()
    if collector is None or not captured.slots:
        return
    for (key, slot), tensor in zip(captured.slots, tensors, strict=True):
        collector[key][slot] = tensor


@contextmanager
def recording(captured: Captured | None) -> Iterator[dict[str, list[Any]]]:
    """A fresh collector shaped as the forward's was (same keys, same prior lengths), so a
    re-run's hooks record the same tensors in the same slots; yields it."""
    fresh: dict[str, Any] = {}
    var = _collector_var()
    if var is None:
        yield fresh
        return
    if captured is not None and captured.slots:
        fresh.update({k: [None] * n for k, n in captured.prior.items()})
    token = var.set(fresh or None)
    try:
        yield fresh
    finally:
        var.reset(token)


def recorded(fresh: dict[str, list[Any]], captured: Captured | None) -> list[torch.Tensor]:
    """The tensors a re-run recorded in the forward's capture slots."""
    if captured is None:
        return []
    return [fresh[key][slot] for key, slot in captured.slots]


def collector_lengths() -> dict[str, int]:
    """Each list's length in the live collector now ({} when none is active)."""
    collector = _collector()
    return {k: len(v) for k, v in (collector or {}).items() if isinstance(v, list)}


def take_appended(prior: dict[str, int]) -> list[tuple[str, Any]]:
    """Remove from the live collector what was appended since `prior` (its lengths then);
    return it as (key, value) pairs, in order."""
    collector = _collector()
    taken = []
    for key, start in prior.items():
        taken += [(key, value) for value in collector[key][start:]]
        del collector[key][start:]
    return taken


def append(key: str, value: Any) -> None:
    """Append `value` to the live collector's list `key`."""
    _collector()[key].append(value)


@contextmanager
def collecting(keys: list[str]) -> Iterator[None]:
    """A throwaway collector with empty lists for `keys` (none at all when `keys` is
    empty), so that a recomputation's hooks record where `take_appended` finds them."""
    var = _collector_var()
    if var is None:
        yield
        return
    token = var.set({k: [] for k in keys} or None)
    try:
        yield
    finally:
        var.reset(token)
