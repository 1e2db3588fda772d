"""Global gradient norm from foreach per-tensor norms, and the clip coefficient.

The norm is a read-only pass (foreach kernels, fp32 accumulation even for bf16
gradients); the clip coefficient is then applied inside the fused update, so gradients
are never rewritten. Norms the engine accumulated while gradients streamed in replace
that pass for the tensors they cover. The arithmetic mirrors `torch.nn.utils.
clip_grad_norm_` so that clipping inside the update equals clip_grad_norm_ + step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

#: Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
CLIP_EPS = 1e-6
#: Gradients of fewer elements in all are measured on the calling thread: below ~4 MiB
#: the pass takes under ~0.2 ms, about what handing it to other threads costs.
PARALLEL_NORM_MIN_NUMEL = 1 << 20


def total_grad_norm(
    grads: Sequence[torch.Tensor], precomputed_sq_norms: Sequence[float] = ()
) -> torch.Tensor:
    """fp32 L2 norm over `grads` and over tensors whose squared norms are precomputed."""
    return combine_norms(tensor_norms(grads), precomputed_sq_norms)


def tensor_norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's fp32 L2 norm (foreach, per device), in the order given."""
    per_tensor: list[torch.Tensor] = []
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, device_grads in by_device.items():
        if device.type == "cpu":
            per_tensor.extend(_cpu_norms(device_grads))
        else:
            norms = torch._foreach_norm(device_grads, 2.0, dtype=torch.float32)
            per_tensor.extend(norm.cpu() for norm in norms)
    return per_tensor


def _cpu_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`torch._foreach_norm(grads, 2.0, dtype=float32)` with the tensors shared among torch's
    threads. On CPU torch reduces each tensor on one thread (a full reduction has one output
    row), so a foreach norm over a model's gradients used one core of N. Each shard runs
    the same per-tensor kernel: the same bits as one foreach call, in the order given."""
    threads = min(torch.get_num_threads(), len(grads))
    if threads < 2 or sum(g.numel() for g in grads) < PARALLEL_NORM_MIN_NUMEL:
        return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    shards: list[list[int]] = [[] for _ in range(threads)]
    shard_numel = [0] * threads
    for i in sorted(range(len(grads)), key=lambda i: -grads[i].numel()):  # largest first
        least = shard_numel.index(min(shard_numel))
        shards[least].append(i)
        shard_numel[least] += grads[i].numel()
    norms: list[torch.Tensor | None] = [None] * len(grads)

    def measure(shard: list[int]) -> None:
        shard_norms = torch._foreach_norm([grads[i] for i in shard], 2.0, dtype=torch.float32)
        for i, norm in zip(shard, shard_norms, strict=True):
            norms[i] = norm

    list(_norm_pool(threads).map(measure, shards))  # list(): re-raises a shard's error
    return [norm for norm in norms if norm is not None]


@functools.cache
def _norm_pool(threads: int) -> ThreadPoolExecutor:
    """Threads kept for `_cpu_norms` (idle between steps; starting them costs ~0.1 ms)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lazytrain-norm")


def combine_norms(norms: Sequence[torch.Tensor], precomputed_sq_norms: Sequence[float] = ()
                  ) -> torch.Tensor:
    """The fp32 L2 norm of the vector of per-tensor `norms` followed by the square roots
    of `precomputed_sq_norms`. The order of the entries is part of the result's last bit
    (`vector_norm` sums them vectorized): a caller that must equal another computation
    bit for bit lists the same values in the same order."""
    per_tensor = list(norms)
    if precomputed_sq_norms:
        squares = torch.tensor(list(precomputed_sq_norms), dtype=torch.float32)
        per_tensor.extend(squares.sqrt().unbind())
    if not per_tensor:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(per_tensor), 2.0)


def clip_coefficient(total_norm: torch.Tensor, max_grad_norm: float) -> float:
    """The factor (<= 1) that brings the global norm down to `max_grad_norm`."""
    coef = torch.clamp(max_grad_norm / (total_norm + CLIP_EPS), max=1.0)
    return float(coef)


def split_precomputed(
    params: Sequence[torch.nn.Parameter], sq_norms: Mapping[torch.nn.Parameter, float]
) -> tuple[list[torch.Tensor], list[float]]:
    """(gradients still to measure, squared norms already known) for params with a grad;
    a known norm counts without one (the engine's of a gradient waiting in a file:
    `engine/memory/grad_files.py`)."""
    to_measure: list[torch.Tensor] = []
    known: list[float] = []
    for param in params:
        if param in sq_norms:
            known.append(float(sq_norms[param]))
        elif param.grad is not None:
            to_measure.append(param.grad)
    return to_measure, known


def ordered_total_norm(
    params: Sequence[torch.nn.Parameter],
    measured_norms: Mapping[torch.nn.Parameter, float],
    sq_norms: Mapping[torch.nn.Parameter, float],
) -> torch.Tensor:
    """`total_grad_norm(*split_precomputed(params, sq_norms))` from per-parameter values
    gathered from the processes that hold the gradients (a split update): `measured_norms`
    for the gradients without a precomputed squared norm (`tensor_norms`), the
    precomputed `sq_norms` for the others. The same entries in the same order (measured
    first, then precomputed, each in `params` order): the same fp32 norm, bit for bit."""
    return combine_norms(
        [torch.tensor(measured_norms[p], dtype=torch.float32) for p in params
         if p in measured_norms],
        [sq_norms[p] for p in params if p in sq_norms])
