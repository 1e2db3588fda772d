"""Binding a decoder-layer call to `(hidden, **kwargs)`, whatever mix of positions it used.

GPT-2 and GPTBigCode pass arguments positionally; the layer Function needs the hidden
state first and everything else by name. Training calls also drop KV-cache arguments, so
that re-running a layer in backward never writes a cache a second time.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lazytrain_accel.engine.model.discovery import UnsupportedModelError

#: Keyword names under which HF layers receive a KV cache, and the flag that fills it.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def bind_call(sig: inspect.Signature, index: int, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """(hidden, keyword arguments) of a call of decoder layer `index` with signature `sig`."""
    bound = sig.bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    hidden = arguments.pop(next(iter(sig.parameters)))
    call_kwargs: dict[str, Any] = {}
    for name, value in arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            call_kwargs.update(value)
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise UnsupportedModelError(
                    f"decoder layer {index} was called with extra positional arguments "
                    f"({len(value)}) its signature {sig} cannot name; pass them by keyword")
        else:
            call_kwargs[name] = value
    if not isinstance(hidden, torch.Tensor):
        raise UnsupportedModelError(f"decoder layer {index}'s first argument is "
                                    f"{type(hidden).__name__}, not the hidden-state tensor")
    return hidden, call_kwargs


def drop_cache(call_kwargs: dict[str, Any]) -> None:
    """Re-runs must not write the KV cache a second time: no cache in a training call."""
    for name in _CACHE_KWARGS:
        if call_kwargs.get(name) is not None:
            call_kwargs[name] = None
    if call_kwargs.get("use_cache"):
        call_kwargs["use_cache"] = False
