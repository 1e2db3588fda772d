"""Data parallelism over torch.distributed for a streamed model.

Each rank streams all layers of its own copy and computes gradients for its shard of the
global batch. As a layer's gradients land on the host (the engine's grad-ready hook), an
asynchronous all-reduce of that layer starts, so communication of layer j overlaps the
backward of layer j-1. Before the optimizer step `finish()` waits for all of them and
averages. Optimizer state is replicated: every rank applies the same update to the same
masters. This is the fallback of the node store (`node_store.py`, `split_update.py`), which
shares one host copy per node and splits the update across the local ranks:
`node_store="off"`, and launchers that give no `LOCAL_WORLD_SIZE` dividing the processes
into nodes, use this path.
Works with gloo (CPU tensors) and NCCL alike because the reduced tensors are host copies
under gloo and device copies under NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class GradReadyHooks(Protocol):
    """What the reducer needs of the engine (`StreamingEngine`)."""

    def register_grad_ready_hook(self, hook: Callable[[list[nn.Parameter]], None]
                                 ) -> None: ...

    def refresh_grad_sq_norms(self, params: list[nn.Parameter]) -> None: ...


class GradientAllReducer:
    """Overlapped per-layer gradient averaging across the default process group."""

    def __init__(self, engine: GradReadyHooks, model: nn.Module, *,
                 should_reduce: Callable[[], bool] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("data-parallel LazyTrain needs torch.distributed initialized; "
                               "start the script with `accelerate launch --num_processes N`")
        self._world_size = dist.get_world_size()
        self._should_reduce = should_reduce or (lambda: True)
        self._pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []
        self._reduced: set[int] = set()
        self._model = model
        self._engine = engine
        self._backend_device = reduce_device()
        engine.register_grad_ready_hook(self._on_layer_grads)

    def _on_layer_grads(self, params: list[nn.Parameter]) -> None:
        if not self._should_reduce():
            return
        self._launch([p for p in params if p.grad is not None])

    def _launch(self, params: list[nn.Parameter]) -> None:
        if not params:
            return
        flat = flat_grads(params, self._backend_device)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        self._pending.append((work, flat, params))
        self._reduced.update(id(p) for p in params)

    def finish(self) -> None:
        """Reduce what the hooks did not cover (resident modules), wait, average; then
        the engine re-measures its recorded norms, so every rank clips by the global
        norm and skips a non-finite step together."""
        rest = [p for p in self._model.parameters()
                if p.grad is not None and id(p) not in self._reduced]
        self._launch(rest)
        for work, flat, params in self._pending:
            work.wait()
            write_mean_grads(flat, params, self._world_size)
            self._engine.refresh_grad_sq_norms(params)
        self._pending.clear()
        self._reduced.clear()


def reduce_device() -> torch.device:
    """Where the collectives take their tensors: the current GPU under NCCL, the host
    under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def flat_grads(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The `.grad`s of `params` as one fp32 vector on `device` (what one collective sends).
    One contiguous fp32 gradient already on `device` is sent as it is, not copied: a
    resident's (an embedding's) is the largest tensor a rank holds, and a copy beside it
    doubled its bytes on every rank while its reduce ran."""
    if len(params) == 1:
        grad = params[0].grad
        if grad.dtype == torch.float32 and grad.is_contiguous() and grad.device == device:
            return grad.view(-1)
    flat = torch.cat([p.grad.reshape(-1).to(torch.float32) for p in params])
    return flat.to(device, non_blocking=True)


def write_mean_grads(flat: torch.Tensor, params: list[nn.Parameter], world_size: int) -> None:
    """Each parameter's `.grad` becomes its slice of `flat` (the ranks' summed gradients,
    flattened in `params` order) divided by `world_size`: the mean over the ranks."""
    flat = flat.to("cpu").div_(world_size)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
