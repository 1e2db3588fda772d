"""`LazyLogits`: what the head returns while the fused loss is on — logits never computed.

A tensor subclass with no storage, standing for `head(hidden)` of shape (..., vocab). It
lets the model's own forward and loss code run unchanged: the few operations HF code does
between the head and `F.cross_entropy` (scaling, Gemma's softcapping, `.float()`, the
flattening `.view(-1, vocab)`) are recorded, and `F.cross_entropy` on it runs the fused,
chunked loss. Any other operation (a custom loss reading the logits) raises an error
that names it, so nothing silently computes on logits that do not exist.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from lazytrain_accel.engine.loss.fused_loss import LogitOp, fused_linear_cross_entropy


class LogitsNotMaterializedError(NotImplementedError):
    """An operation needed the logits, which the fused chunked loss never builds."""


_UNSUPPORTED = ("the fused loss (loss_chunk_tokens > 0) never materializes the logits, so "
                "the model's forward or loss function may only scale, tanh-cap, upcast and "
                "flatten them before F.cross_entropy. Set loss_chunk_tokens=0 (the model's "
                "own loss) for this model or loss function.")


class LazyLogits(torch.Tensor):
    """Stands for `F.linear(hidden, weight, bias)` followed by `ops`; shape (..., vocab)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    compute_dtype: torch.dtype
    ops: tuple[LogitOp, ...]
    chunk_tokens: int

    @staticmethod
    def __new__(cls, *, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                compute_dtype: torch.dtype, chunk_tokens: int,
                ops: tuple[LogitOp, ...] = (), shape: tuple[int, ...] | None = None,
                dtype: torch.dtype | None = None) -> LazyLogits:
        shape = shape or (*hidden.shape[:-1], weight.shape[0])
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or compute_dtype,
                                                   device=hidden.device)
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.compute_dtype, self.chunk_tokens, self.ops = compute_dtype, chunk_tokens, ops
        return self

    def __repr__(self, **_: Any) -> str:
        return (f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"ops={[op.kind for op in self.ops]})")

    def _derive(self, *, op: LogitOp | None = None, shape: tuple[int, ...] | None = None
                ) -> LazyLogits:
        dtype = torch.float32 if op is not None and op.kind == "upcast" else self.dtype
        return LazyLogits(hidden=self.hidden, weight=self.weight, bias=self.bias,
                          compute_dtype=self.compute_dtype, chunk_tokens=self.chunk_tokens,
                          ops=self.ops + ((op,) if op else ()), shape=shape or tuple(self.shape),
                          dtype=dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is None:
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            raise LogitsNotMaterializedError(f"{name} on the logits: {_UNSUPPORTED}")
        return handler(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # Reached only by ops that bypass __torch_function__ (C++ internals).
        raise LogitsNotMaterializedError(f"{func} on the logits: {_UNSUPPORTED}")


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
             torch.Tensor.is_floating_point, torch.Tensor.__len__}


def _scalar(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor) and not isinstance(value, LazyLogits):
        if value.numel() != 1:
            raise LogitsNotMaterializedError(
                f"{what} by a tensor of shape {tuple(value.shape)}: {_UNSUPPORTED}")
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise LogitsNotMaterializedError(f"{what} by {type(value).__name__}: {_UNSUPPORTED}")


def _mul(a: Any, b: Any) -> LazyLogits:
    lazy, other = (a, b) if isinstance(a, LazyLogits) else (b, a)
    return lazy._derive(op=LogitOp(kind="mul", value=_scalar(other, "multiplying")))


def _div(a: Any, b: Any, *, rounding_mode: str | None = None) -> LazyLogits:
    if not isinstance(a, LazyLogits) or rounding_mode is not None:
        raise LogitsNotMaterializedError(f"dividing by the logits or rounding: {_UNSUPPORTED}")
    return a._derive(op=LogitOp(kind="div", value=_scalar(b, "dividing")))


def _tanh(a: LazyLogits) -> LazyLogits:
    return a._derive(op=LogitOp(kind="tanh"))


def _to_float(a: LazyLogits, *_: Any, **__: Any) -> LazyLogits:
    return a if a.dtype == torch.float32 else a._derive(op=LogitOp(kind="upcast"))


def _same(a: LazyLogits, *_: Any, **__: Any) -> LazyLogits:
    return a


def _to(a: LazyLogits, *args: Any, **kwargs: Any) -> LazyLogits:
    """`.to(device)` to its own device and `.to(torch.float32)` only."""
    targets = [*args, kwargs.get("dtype"), kwargs.get("device")]
    for target in targets:
        if target is None or isinstance(target, bool):
            continue
        if isinstance(target, torch.dtype):
            if target == torch.float32:
                a = _to_float(a)
            elif target != a.dtype:
                raise LogitsNotMaterializedError(f".to({target}) on the logits: {_UNSUPPORTED}")
        elif isinstance(target, (str, torch.device)) and _same_device(target, a.device):
            continue
        else:
            raise LogitsNotMaterializedError(f".to({target!r}) on the logits: {_UNSUPPORTED}")
    return a


def _same_device(target: str | torch.device, device: torch.device) -> bool:
    wanted = torch.device(target)
    return wanted.type == device.type and wanted.index in (None, device.index)


def _view(a: LazyLogits, *shape: Any) -> LazyLogits:
    """A reshape that keeps rows whole and in order: only the leading dims may change."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    vocab, rows = a.shape[-1], math.prod(a.shape[:-1])
    sizes = list(shape)
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = (rows * vocab) // known if known else 0
    if not sizes or sizes[-1] != vocab or math.prod(sizes[:-1]) != rows:
        raise LogitsNotMaterializedError(
            f"reshaping logits {tuple(a.shape)} to {tuple(shape)} (only (..., vocab) shapes "
            f"keep rows whole): {_UNSUPPORTED}")
    return a._derive(shape=tuple(sizes))


_CE_SIGNATURE = inspect.signature(F.cross_entropy)


def _cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
    bound = _CE_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    arg = bound.arguments
    logits, target = arg["input"], arg["target"]
    if not isinstance(logits, LazyLogits) or logits.dim() != 2:
        raise LogitsNotMaterializedError(
            f"F.cross_entropy on logits of shape {tuple(logits.shape)} (expected (tokens, "
            f"vocab)): {_UNSUPPORTED}")
    extras = {name: arg[name] for name in ("weight", "size_average", "reduce")
              if arg[name] is not None}
    if arg["label_smoothing"]:
        extras["label_smoothing"] = arg["label_smoothing"]
    if extras or arg["reduction"] not in ("mean", "sum"):
        raise LogitsNotMaterializedError(
            f"F.cross_entropy with {extras or arg['reduction']!r}: the fused loss supports "
            "reduction 'mean'/'sum' without class weights or label smoothing; set "
            "loss_chunk_tokens=0")
    return fused_linear_cross_entropy(
        logits.hidden, logits.weight, target, bias=logits.bias,
        chunk_tokens=logits.chunk_tokens, ignore_index=arg["ignore_index"],
        reduction=arg["reduction"], compute_dtype=logits.compute_dtype, logit_ops=logits.ops)


_HANDLERS = {
    torch.Tensor.__mul__: _mul, torch.Tensor.__rmul__: _mul, torch.Tensor.mul: _mul,
    torch.mul: _mul,
    torch.Tensor.__truediv__: _div, torch.Tensor.div: _div,
    torch.div: _div, torch.true_divide: _div,
    torch.tanh: _tanh, torch.Tensor.tanh: _tanh,
    torch.Tensor.float: _to_float, torch.Tensor.to: _to,
    torch.Tensor.contiguous: _same,
    torch.Tensor.view: _view, torch.Tensor.reshape: _view, torch.reshape: _view,
    F.cross_entropy: _cross_entropy,
}
