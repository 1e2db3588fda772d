"""HF's own activation checkpointing, absorbed: a streamed model keeps it off.

A user who asks for gradient checkpointing (`--gradient_checkpointing`, TRL's default
`SFTConfig`, `model.gradient_checkpointing_enable()`) asks for memory savings, which the
plan already gives: the engine re-runs each layer in backward and recomputes what the plan
says. HF's checkpoint wrapper around a streamed layer would run it (and its weight stream)
a third time, so the engine turns the flags off when it attaches and keeps them off when
checkpointing is enabled later, by wrapping `_set_gradient_checkpointing` on the model's
instances (the one method every enable path of transformers 5 goes through).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

_WRAPPED = "_set_gradient_checkpointing"
_ON_ENABLE = "_lazytrain_on_checkpointing_enabled"


class _Callback:
    """Holds the engine's callback; a deep copy of the model gets None (a plain model)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _none, ()


def _none() -> None:
    return None


def turn_off(model: nn.Module) -> bool:
    """Switch HF checkpointing off on every module of `model`; say whether any was on."""
    was_on = False
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.gradient_checkpointing = False
            was_on = True
    return was_on


def _set_kept_off(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    getattr(type(self), _WRAPPED)(self, *args, **kwargs)
    callback = self.__dict__.get(_ON_ENABLE)
    if callback is not None:
        callback.fn()


def keep_off(model: nn.Module, on_enable: Callable[[], None]) -> list[nn.Module]:
    """Route every later enable through `on_enable` (which turns the flags off again);
    return the patched modules for `restore`."""
    patched = []
    for module in model.modules():
        if callable(getattr(type(module), _WRAPPED, None)) and _WRAPPED not in module.__dict__:
            module.__dict__[_WRAPPED] = types.MethodType(_set_kept_off, module)
            module.__dict__[_ON_ENABLE] = _Callback(on_enable)
            patched.append(module)
    return patched


def restore(patched: list[nn.Module]) -> None:
    """Give the modules back their own `_set_gradient_checkpointing`."""
    for module in patched:
        module.__dict__.pop(_WRAPPED, None)
        module.__dict__.pop(_ON_ENABLE, None)
