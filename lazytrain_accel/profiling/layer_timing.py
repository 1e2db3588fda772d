"""The model's own compute rate: its first decoder layer and its head timed at the run's
batch shape and dtype, on the device the run computes on.

The square matmul of `measure.py` is a roofline: a 128-wide layer runs at about half of
it on a CPU, a GPU's attention and norms well below it. What the planner prices is the
model's layers, so `prepare` times them (`time_model_compute`) and prices compute at the
rate they reached (`achieved_flops_per_s`): a few runs of one layer, well under a second.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lazytrain_accel.profiling.profile import ModelProfile
from lazytrain_accel.storage.flat import flat_views


@dataclass(frozen=True, kw_only=True)
class ComputeTiming:
    """Seconds of the model's own compute at one batch shape, medians of a few runs."""

    layer_forward_s: float  # one layer's forward without grad (a forward run, a re-run)
    layer_backward_s: float  # its forward with grad and its backward (a backward run)
    head_s: float  # the head and the loss, forward and backward

    def flops_per_s(self, profile: ModelProfile) -> float:
        """The rate a step of `profile`'s model computes at: every layer's forward and
        backward run and the head, as the planner prices them (`planning/problem.py`:
        a backward run re-runs the forward; the head's backward is twice its forward)."""
        layers = profile.num_layers
        flops = (layers * (2 * profile.layer_fwd_flops + profile.layer_bwd_flops)
                 + 3 * profile.head_fwd_flops)
        seconds = layers * (self.layer_forward_s + self.layer_backward_s) + self.head_s
        return flops / seconds


class _Captured(Exception):
    """Raised by the capture hook: the layer's inputs are in hand, the model need not go on."""


def _first_layer_inputs(model: nn.Module, layer: nn.Module, *, batch_size: int,
                        seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword inputs `layer` gets in a forward of `model` on a batch
    of `batch_size` x `seq_len` tokens (embeddings, masks, rotary tables: the model's own),
    read by a pre-hook that stops the forward there."""
    captured: dict[str, Any] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Captured

    device = next(model.parameters()).device
    ids = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad(), contextlib.suppress(_Captured):
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    if "args" not in captured:
        raise RuntimeError(f"a forward of {type(model).__name__} never called its first "
                           "decoder layer")
    return captured["args"], captured["kwargs"]


def _to(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """`value` (a tensor, or tuples/lists/dicts of them) on `device`, floats in `dtype`."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.detach().to(device=device, dtype=cast)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _medians_s(runs: list[Callable[[], None]], device: torch.device, *, repeats: int,
               budget_s: float) -> list[float]:
    """Median wall seconds of each of `runs`, called in turn (a change of load hits them
    alike) after two warm-up rounds: `repeats` rounds, fewer (at least 3) where they
    would take more than `budget_s`."""
    for _ in range(2):
        for run in runs:
            run()
    _sync(device)
    times: list[list[float]] = [[] for _ in runs]
    began = time.perf_counter()
    for round_ in range(repeats):
        for run, seconds in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            _sync(device)
            seconds.append(time.perf_counter() - start)
        if round_ >= 2 and time.perf_counter() - began > budget_s:
            break
    return [statistics.median(seconds) for seconds in times]


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple | list) else output


def time_model_compute(model: nn.Module, layers: nn.ModuleList, *, batch_size: int,
                       seq_len: int, device: torch.device, compute_dtype: torch.dtype | None,
                       repeats: int = 25, budget_s: float = 1.0) -> ComputeTiming:
    """Time a copy of `layers[0]` (a decoder layer of `model`, which still holds its own
    weights: before the engine is attached) on its real inputs at `batch_size` x
    `seq_len`, and a copy of the head with its loss, on `device` in `compute_dtype`
    (None: fp32), under autocast as the run computes: `repeats` rounds within about
    `budget_s` seconds."""
    args, kwargs = _first_layer_inputs(model, layers[0], batch_size=batch_size,
                                       seq_len=seq_len)
    layer = _device_copy(layers[0], device, compute_dtype)
    hidden = _to(args[0], device, compute_dtype)
    rest = _to(args[1:], device, compute_dtype)
    kwargs = {k: v for k, v in _to(kwargs, device, compute_dtype).items()
              if k not in ("past_key_value", "past_key_values")}
    grad = torch.ones_like(hidden)

    def forward() -> None:
        with torch.no_grad(), _autocast(device, compute_dtype):
            layer(hidden, *rest, **kwargs)

    def backward() -> None:
        leaf = hidden.detach().requires_grad_(True)
        with _autocast(device, compute_dtype):
            out = _first_tensor(layer(leaf, *rest, **kwargs))
        out.backward(grad.to(out.dtype))
        layer.zero_grad(set_to_none=True)

    runs = [forward, backward]
    head = _head_run(model, hidden, device, compute_dtype)
    if head is not None:
        runs.append(head)
    seconds = _medians_s(runs, device, repeats=repeats, budget_s=budget_s)
    return ComputeTiming(layer_forward_s=seconds[0], layer_backward_s=seconds[1],
                         head_s=seconds[2] if head is not None else 0.0)


def _device_copy(module: nn.Module, device: torch.device, dtype: torch.dtype | None
                 ) -> nn.Module:
    """A copy of `module` on `device`, its floating parameters in `dtype` (None: kept)."""
    copied = copy.deepcopy(module).to(device)
    return copied if dtype is None else copied.to(dtype)


def _head_run(model: nn.Module, hidden: torch.Tensor, device: torch.device,
              compute_dtype: torch.dtype | None) -> Callable[[], None] | None:
    """One forward and backward of a copy of the output head and a cross-entropy loss on
    `hidden`; None for a model without output embeddings."""
    get_head = getattr(model, "get_output_embeddings", None)
    head_module = get_head() if get_head is not None else None
    if head_module is None:
        return None
    head = _device_copy(head_module, device, compute_dtype)
    labels = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=device).view(-1)

    def run() -> None:
        leaf = hidden.detach().requires_grad_(True)
        with _autocast(device, compute_dtype):
            logits = head(leaf)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels)
        loss.backward()
        head.zero_grad(set_to_none=True)

    return run


#: The most parameters `time_layer_update` updates and `time_layer_copies` copies: a 70B
#: layer's 856M would take several GB of host memory and seconds at `prepare`; past this
#: the rate on large tensors is what the layer runs at anyway.
MAX_TIMED_UPDATE_PARAMS = 16 * 2**20


def _first_elements(tensors: Iterator[torch.Tensor], limit: int) -> list[torch.Tensor]:
    """`tensors` (detached) in order up to `limit` elements in all, the last one cut
    (flattened) where it would pass it."""
    taken, left = [], limit
    for t in tensors:
        if left == 0:
            break
        taken.append(t.detach() if t.numel() <= left else t.detach().reshape(-1)[:left])
        left -= taken[-1].numel()
    return taken


def time_layer_update(layer: nn.Module, *, compute_dtype: torch.dtype | None,
                      on_gpu: bool, repeats: int = 9, budget_s: float = 1.0) -> float:
    """Params/s of the host update of a copy of `layer`'s trainable parameters, as the
    engine's update runs one layer's group: one clipped HybridAdamW8bit step with the
    norms given, through `step_params` (its per-tensor work included: small tensors such
    as norms keep fp32 moments and take the reference path), writing the compute-dtype
    copy in the same pass where a GPU streams it (`on_gpu`, a bf16 compute dtype). Of a
    layer larger than `MAX_TIMED_UPDATE_PARAMS`, its tensors in order up to that many
    (the last one cut). The measure's 10M-parameter probe is the kernel's rate on one
    large tensor; a 256-wide layer's group ran at a third of it on a 2-core Xeon
    (docs/benchmarks.md "The plan at prepare")."""
    from lazytrain_accel.profiling.measure import clipped_step

    params = [nn.Parameter(t.to("cpu", torch.float32).clone()) for t in _first_elements(
        (p for p in layer.parameters() if p.requires_grad), MAX_TIMED_UPDATE_PARAMS)]
    if not params:
        raise ValueError("the layer has no trainable parameters to time an update of")
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    copies = ([torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
              if on_gpu and compute_dtype == torch.bfloat16 else None)
    step = clipped_step(params, copies)
    seconds = _medians_s([step], torch.device("cpu"), repeats=repeats, budget_s=budget_s)[0]
    return sum(p.numel() for p in params) / seconds


@dataclass(frozen=True, kw_only=True)
class CopyTiming:
    """Bytes/s of the training thread's copies of one layer, as the engine makes them
    (`engine/memory/weights.py`, `grads.py`), each a median of a few runs."""

    stage_bytes_per_s: float  # its parameters copied tensor by tensor into a flat buffer
    fold_bytes_per_s: float | None  # its gradients handed back (None: nothing trainable)


def time_layer_copies(layer: nn.Module, *, compute_dtype: torch.dtype | None,
                      device_runs_async: bool, repeats: int = 9,
                      budget_s: float = 0.5) -> CopyTiming:
    """Time the per-layer copies of `layer` on the host, at the bytes of `compute_dtype`
    (None: fp32) the engine counts them in. The weights: each parameter copied into its
    view of one flat buffer of the compute dtype (a synchronous device's slot, an async
    device's staging buffer). The gradients of its trainable parameters: on a synchronous
    device autograd's own tensors become `.grad` and only their norms are taken; on an
    async device the staged compute-dtype gradients are copied into fp32 `.grad` storage
    first. A layer's dozen tensors copy at a fraction of one large buffer's rate (the
    machine probe's): their per-tensor overhead is most of a small layer's load. Of a
    layer larger than `MAX_TIMED_UPDATE_PARAMS`, its tensors in order up to that many."""
    dtype = compute_dtype or torch.float32
    params = [t.to("cpu") for t in _first_elements(layer.parameters(),
                                                   MAX_TIMED_UPDATE_PARAMS)]
    if not params:
        raise ValueError("the layer has no parameters to time the copies of")
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype)
    views = flat_views(flat, params)

    def stage() -> None:
        for view, master in zip(views, params, strict=True):
            view.copy_(master)

    runs = [stage]
    trainable = [t.to("cpu", torch.float32) for t in _first_elements(
        (p for p in layer.parameters() if p.requires_grad), MAX_TIMED_UPDATE_PARAMS)]
    grads = [torch.randn_like(p) for p in trainable]
    staged = flat_views(torch.empty(sum(p.numel() for p in trainable), dtype=dtype), trainable)

    def fold() -> None:
        if device_runs_async:
            for grad, view in zip(grads, staged, strict=True):
                grad.copy_(view)
        torch.stack(torch._foreach_norm(grads)).square().tolist()

    if trainable:
        runs.append(fold)
    seconds = _medians_s(runs, torch.device("cpu"), repeats=repeats, budget_s=budget_s)
    grad_bytes = sum(g.numel() for g in grads) * flat.element_size()
    return CopyTiming(stage_bytes_per_s=flat.numel() * flat.element_size() / seconds[0],
                      fold_bytes_per_s=grad_bytes / seconds[1] if trainable else None)

