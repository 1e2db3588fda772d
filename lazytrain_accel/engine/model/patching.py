"""Patching a model for its engine, and restoring it: instance forwards, links and hooks.

Each decoder layer's `forward` is replaced on the instance by `_streamed_forward`, which
finds its engine through a `_Link` attribute; hooks on the model and on the decoder stack
bracket each pass (`StreamingEngine.before_model` / `after_model` / `new_pass` /
`end_pass`), `state_dict()` / `load_state_dict()` first wait for a running update, and
(torch has no hook for them: docs/architecture.md "Patched points") `parameters()` /
`named_parameters()` wait for it and `zero_grad()` is deferred while it runs.
`ModelPatch.restore()` undoes all of it (`StreamingEngine.detach`).
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Protocol

import torch
from torch import nn

_LINK = "_lazytrain_engine_link"


class PatchedEngine(Protocol):
    """What the patches call on their engine (`StreamingEngine`): this module depends on
    this interface, not on `engine.py`, which imports it."""

    def call_layer(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run decoder layer `index` (1-based) on the call's arguments."""
        ...

    def before_model(self) -> None: ...
    def after_model(self) -> None: ...
    def new_pass(self) -> None: ...
    def check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse the decoder stack's inputs before it builds its masks."""
        ...

    def end_pass(self) -> None: ...
    def before_head(self) -> None: ...

    def synchronize(self) -> None:
        """Wait for a running optimizer update (before the masters are read or written)."""
        ...

    def queue_finalizer(self) -> None:
        """Queue the end-of-backward callback (a resident's gradient has accumulated)."""
        ...

    def defer_zero_grad(self, set_to_none: bool) -> bool:
        """Whether a running update took the `zero_grad()` over (see `LayerwiseUpdate`)."""
        ...

    def wait_for_reads(self) -> None:
        """Wait for this rank's running update (if any): its masters are about to be read."""
        ...


def _none() -> None:
    return None


class _Link:
    """Attribute tying a layer (or hooked module) to its engine.

    The model owns its engine through these links (an ordinary, collectable cycle). A deep
    copy or a pickle of the model gets None instead, so the copy's layers run their own
    forward and its hooks do nothing: the copy is a plain, self-contained model.
    """

    def __init__(self, engine: PatchedEngine, index: int = 0) -> None:
        self.engine, self.index = engine, index

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _none, ()


def _on(method: str) -> Any:
    """A hook calling `engine.<method>()` for the engine linked to its module."""
    def hook(module: nn.Module, *_: Any) -> None:
        link = module.__dict__.get(_LINK)
        if link is not None:
            getattr(link.engine, method)()
    return hook


def _check_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    link = module.__dict__.get(_LINK)
    if link is not None:
        link.engine.check_inputs(args, kwargs)


def _read_after_update(name: str) -> Any:
    """`model.parameters()` / `named_parameters()`: the module's own, once a running
    update is whole, so a loop that reads the weights right after `optimizer.step()`
    reads updated ones."""
    def read(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        link = model.__dict__.get(_LINK)
        if link is not None:
            link.engine.wait_for_reads()
        return getattr(type(model), name)(model, *args, **kwargs)
    return read


#: The model's methods replaced on the instance at attach (docs/architecture.md
#: "Patched points"): the reads wait for a running update, `zero_grad` defers to it.
_MODEL_METHODS = ("parameters", "named_parameters", "zero_grad")


def _zero_grad_after_update(model: nn.Module, set_to_none: bool = True) -> None:
    """`model.zero_grad()`: deferred per group while an update runs (the Trainer calls it
    right after `optimizer.step()`), else the module's own."""
    link = model.__dict__.get(_LINK)
    if link is None or not link.engine.defer_zero_grad(set_to_none):
        type(model).zero_grad(model, set_to_none)


def _streamed_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    link = layer.__dict__.get(_LINK)
    if link is None:
        return type(layer).forward(layer, *args, **kwargs)
    return link.engine.call_layer(link.index, args, kwargs)


class ModelPatch:
    """The instance patches of one engine on its model, undone by `restore()`."""

    def __init__(self, engine: PatchedEngine, model: nn.Module, parent: nn.Module,
                 layers: list[nn.Module], residents: list[nn.Parameter], *,
                 head_modules: list[nn.Module]) -> None:
        self._layers = layers
        self._saved_forwards = [layer.__dict__.get("forward") for layer in layers]
        for index, layer in enumerate(layers, start=1):
            layer.forward = types.MethodType(_streamed_forward, layer)
            layer.__dict__[_LINK] = _Link(engine, index)
        self._model = model
        self._saved_methods = {name: model.__dict__.get(name) for name in _MODEL_METHODS}
        model.parameters = types.MethodType(_read_after_update("parameters"), model)
        model.named_parameters = types.MethodType(_read_after_update("named_parameters"), model)
        model.zero_grad = types.MethodType(_zero_grad_after_update, model)
        self._linked = [model, parent, *head_modules]
        for module in self._linked:
            module.__dict__[_LINK] = _Link(engine)
        self._handles = [
            model.register_forward_pre_hook(_on("before_model")),
            model.register_forward_hook(_on("after_model")),
            parent.register_forward_pre_hook(_on("new_pass")),
            parent.register_forward_pre_hook(_check_inputs, with_kwargs=True),
            parent.register_forward_hook(_on("end_pass")),
            # masters must not be read or written while the layer-wise update runs
            model.register_state_dict_pre_hook(_on("synchronize")),
            model.register_load_state_dict_pre_hook(_on("synchronize")),
            # the output side's update may still run while the layers do
            *(m.register_forward_pre_hook(_on("before_head")) for m in head_modules),
        ]
        engine_ref = weakref.ref(engine)
        resident_ids = {id(p) for p in residents}

        def on_resident_grad(p: torch.Tensor) -> None:
            engine = engine_ref()
            if engine is not None and id(p) in resident_ids:  # not a deep copy's parameter
                engine.queue_finalizer()

        self._handles += [p.register_post_accumulate_grad_hook(on_resident_grad)
                          for p in residents if p.requires_grad]

    def restore(self) -> None:
        """Own forwards back, links and hooks gone."""
        for handle in self._handles:
            handle.remove()
        for layer, saved in zip(self._layers, self._saved_forwards, strict=True):
            layer.__dict__.pop(_LINK, None)
            if saved is None:
                del layer.forward
            else:
                layer.forward = saved
        for module in self._linked:
            module.__dict__.pop(_LINK, None)
        for name, saved in self._saved_methods.items():
            if saved is None:
                del self._model.__dict__[name]
            else:
                setattr(self._model, name, saved)


def move_buffers(model: nn.Module, device: torch.device) -> dict[nn.Module, torch.device]:
    """Move every buffer to `device` (dtype kept); return each module's original device."""
    moved = {}
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            moved.setdefault(module, buf.device)
            setattr(module, name, buf.to(device))
    return moved


def restore_buffers(devices: dict[nn.Module, torch.device]) -> None:
    """Undo `move_buffers`."""
    for module, device in devices.items():
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))
