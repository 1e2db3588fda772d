"""`apply_fused_loss`: give a HF causal LM *instance* the fused, chunked loss.

Generic over `*ForCausalLM` classes whose forward computes `self.lm_head(hidden)` then
`self.loss_function(...)` (or any loss ending in `F.cross_entropy`): only the instance's
`forward` and its head's `forward` are replaced (never the class). In a training-mode
call with `labels`, the head returns `LazyLogits` (nothing computed), the model's own
loss code runs on it (shift, `ignore_index`, `num_items_in_batch`, softcapping), and
`F.cross_entropy` becomes the fused function. The output's `logits` is None then, as in
Liger-Kernel: a (tokens, vocab) tensor is exactly what this exists to avoid. Evaluation,
`generate()` and calls without labels run the model's own forward untouched.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lazytrain_accel.engine.loss.lazy_logits import LazyLogits
from lazytrain_accel.engine.model.discovery import UnsupportedModelError

_STATE = "_lazytrain_fused_loss"


@dataclass(kw_only=True)
class _FusedLossState:
    """Shared by the model's and the head's patched forwards (a deep copy of the model
    copies it once, so the copy carries its own working fused loss)."""

    chunk_tokens: int
    model_forward: Any  # the forward the patch wraps, bound to the model
    head_forward: Any  # the head's own forward, bound to the head
    signature: inspect.Signature
    enabled: bool = True
    active: int = 0  # > 0 while a training forward with labels runs


class FusedLoss:
    """Handle returned by `apply_fused_loss`; `remove()` restores the model."""

    def __init__(self, model: nn.Module, head: nn.Linear, state: _FusedLossState) -> None:
        self.model, self.head, self._state = model, head, state
        self._saved = {m: m.__dict__.get("forward") for m in (model, head)}

    @property
    def chunk_tokens(self) -> int:
        return self._state.chunk_tokens

    @chunk_tokens.setter
    def chunk_tokens(self, chunk_tokens: int) -> None:
        """A new chunk for the next head call (e.g. a new plan's)."""
        _check_chunk(chunk_tokens)
        self._state.chunk_tokens = chunk_tokens

    def remove(self) -> None:
        """Restore both forwards; if something wrapped ours meanwhile (e.g. Accelerate's
        autocast wrapper), leave the wrapper in place and make ours a pass-through."""
        self._state.enabled = False
        for module, saved in self._saved.items():
            current = module.__dict__.get("forward")
            if isinstance(current, types.MethodType) and current.__func__ in _PATCHES:
                if saved is None:
                    del module.forward
                else:
                    module.forward = saved
                module.__dict__.pop(_STATE, None)


def apply_fused_loss(model: nn.Module, *, chunk_tokens: int) -> FusedLoss:
    """Compute `model`'s training loss with the fused chunked cross-entropy (see module
    doc); `chunk_tokens` tokens' logits exist at a time. Returns a handle to undo it."""
    _check_chunk(chunk_tokens)
    if _STATE in model.__dict__:
        raise ValueError(f"{type(model).__name__} already has the fused loss applied; call "
                         "remove() on its handle first")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        raise UnsupportedModelError(
            f"{type(model).__name__}'s output embeddings are {type(head).__name__}, not an "
            "nn.Linear head: the fused loss needs a HF *ForCausalLM with `lm_head`; set "
            "loss_chunk_tokens=0")
    signature = inspect.signature(model.forward)
    if "labels" not in signature.parameters:
        raise UnsupportedModelError(f"{type(model).__name__}.forward takes no `labels`: the "
                                    "fused loss patches causal-LM forwards; set "
                                    "loss_chunk_tokens=0")
    state = _FusedLossState(chunk_tokens=chunk_tokens, model_forward=model.forward,
                            head_forward=head.forward, signature=signature)
    handle = FusedLoss(model, head, state)
    model.__dict__[_STATE] = head.__dict__[_STATE] = state
    model.forward = types.MethodType(_fused_model_forward, model)
    head.forward = types.MethodType(_fused_head_forward, head)
    return handle


def _check_chunk(chunk_tokens: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive integer (tokens "
                         "whose logits exist at once; 1024-8192 is typical)")


def _fused_model_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _FusedLossState = model.__dict__[_STATE]
    if not (state.enabled and model.training and _has_labels(state, args, kwargs)):
        return state.model_forward(*args, **kwargs)
    state.active += 1
    try:
        out = state.model_forward(*args, **kwargs)
    finally:
        state.active -= 1
    return _without_lazy_logits(out)


def _fused_head_forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    state: _FusedLossState = head.__dict__[_STATE]
    if not (state.enabled and state.active):
        return state.head_forward(hidden)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the dtype autocast gives F.linear
        compute_dtype = torch.get_autocast_dtype(device_type)
    elif hidden.dtype != head.weight.dtype:
        raise TypeError(f"head input is {hidden.dtype} but its weight is {head.weight.dtype} "
                        "and autocast is off: cast the model to one dtype or use autocast")
    else:
        compute_dtype = hidden.dtype
    return LazyLogits(hidden=hidden, weight=head.weight, bias=head.bias,
                      compute_dtype=compute_dtype, chunk_tokens=state.chunk_tokens)


def _has_labels(state: _FusedLossState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        bound = state.signature.bind_partial(*args, **kwargs)
    except TypeError:
        return False  # the model's own forward will raise the precise error
    return bound.arguments.get("labels") is not None


def _without_lazy_logits(out: Any) -> Any:
    """The forward's output with `logits` None (never a LazyLogits left to trip on)."""
    if isinstance(out, tuple):
        return type(out)(None if isinstance(v, LazyLogits) else v for v in out)
    if dataclasses.is_dataclass(out) and hasattr(out, "keys"):  # a HF ModelOutput
        # ModelOutput forbids deleting keys and ignores setting None; rebuild it without.
        return type(out)(**{k: v for k, v in out.items() if not isinstance(v, LazyLogits)})
    return out


_PATCHES = (_fused_model_forward, _fused_head_forward)
