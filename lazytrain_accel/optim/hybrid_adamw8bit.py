"""`HybridAdamW8bit`: AdamW on host fp32 masters with blockwise 8-bit moments.

State per parameter of >= `min_8bit_numel` elements: uint8 codes per element and an fp32
absmax per block for each moment (~2.03 bytes per parameter at block 256); smaller
tensors keep fp32 moments. A step is `begin_step()` (global norm, clip coefficient,
finite check: once), `step_params(...)` over any partition of the parameters (the engine:
layer by layer on its update worker), then `end_step()`; `step()` does all three, or on a
LazyTrain run hands over to `run_step` (`run/step.py:OptimizerStep`). `begin_step()`
freezes each group's hyperparameters for the step. Each update is one fused pass per
tensor (`native.py`, or the bit-identical `reference.py`). docs/optimizer.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lazytrain_accel.device_update import DEVICE_UPDATE_CHUNK_ELEMENTS
from lazytrain_accel.optim import native, reference
from lazytrain_accel.optim.clipping import (
    clip_coefficient,
    ordered_total_norm,
    split_precomputed,
    total_grad_norm,
)
from lazytrain_accel.optim.codes import num_blocks
from lazytrain_accel.optim.skip_count import SkipCount
from lazytrain_accel.optim.state_io import check_loaded_state, load_state_keeping_codes

BACKENDS = ("auto", "native", "torch")
_MAX_BLOCK_SIZE = 4096


@dataclass(kw_only=True)
class _StepContext:
    """What begin_step() decided for the step in progress."""

    apply: bool
    clip_coef: float
    group_of: dict[torch.nn.Parameter, dict[str, Any]]  # hyperparameters, frozen at begin
    updated: set[torch.nn.Parameter] = field(default_factory=set)


class HybridAdamW8bit(torch.optim.Optimizer):
    """AdamW with blockwise 8-bit moments and gradient clipping fused into the update.

    Args:
        params: parameters or param groups (groups may override lr, betas, eps,
            weight_decay, block_size), fp32 masters.
        lr, betas, eps, weight_decay: as `torch.optim.AdamW` (decoupled weight decay).
        max_grad_norm: clip the global L2 norm of the gradients to this (None: no
            clipping). Settable as an attribute between steps.
        block_size: elements per fp32 absmax scale of the 8-bit moments.
        backend: "auto" (native kernel when it builds, else torch), "native", "torch".
        min_8bit_numel: tensors smaller than this keep fp32 moments.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        block_size: int = 256,
        *,
        backend: str = "auto",
        min_8bit_numel: int = 4096,
    ) -> None:
        _check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        _check_block_size(block_size)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0, or None to not clip")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if not isinstance(min_8bit_numel, int) or min_8bit_numel < 0:
            raise ValueError(f"min_8bit_numel={min_8bit_numel!r} must be an int >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        block_size=block_size)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.min_8bit_numel = min_8bit_numel
        #: the steps `begin_step` skipped; on a LazyTrain run the one count of the run's
        #: skipped steps, shared with its `StepGuard` (`optim/skip_count.py`)
        self.skips = SkipCount()
        self.last_grad_norm: float | None = None
        self._kernel = _resolve_kernel(backend)
        self._grad_norm_cache: torch.Tensor | None = None
        self._precomputed_sq_norms: dict[torch.nn.Parameter, float] = {}
        #: (measured norms, precomputed squared norms) of every parameter's gradient,
        #: gathered from the ranks holding them (`set_grad_norm_tables`); None: this
        #: optimizer sees all the gradients
        self._norm_tables: tuple[dict[torch.nn.Parameter, float],
                                 dict[torch.nn.Parameter, float]] | None = None
        self._context: _StepContext | None = None
        #: `step_params` may run on two threads at once (the engine's update thread and,
        #: for residents whose masters live on the device, the training thread): this
        #: guards what they share (the step's updated set, `self.state`'s entries). The
        #: math itself needs no lock: each parameter is updated by one thread, once.
        self._shared_lock = threading.Lock()
        #: Set by the engine that updates this optimizer layer by layer: given a
        #: `zero_grad()`'s `set_to_none`, True if a running update took it over.
        self.zero_grad_gate: Callable[[bool], bool] | None = None
        #: Set once by a LazyTrain run (`run/step.py:OptimizerStep.install`): what
        #: `step(closure)` runs instead, called as `run_step(self, closure)`.
        self.run_step: Callable[[HybridAdamW8bit, Callable[[], float] | None], Any] | None = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                               weight_decay=group["weight_decay"])
        _check_block_size(group["block_size"])
        for param in group["params"]:
            if param.dtype != torch.float32:
                raise ValueError(
                    f"HybridAdamW8bit updates fp32 master weights, got a {param.dtype} parameter "
                    f"of shape {tuple(param.shape)}; keep masters in fp32 (the engine does) and "
                    "cast copies for compute"
                )

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (`self.skips`, read only)."""
        return self.skips.skipped_steps

    # --- gradient norm -----------------------------------------------------------------

    def set_grad_sq_norms(self, sq_norms: Mapping[torch.nn.Parameter, float]) -> None:
        """Use these squared gradient norms (from the engine) instead of measuring them."""
        self._forget_gradients()
        self._precomputed_sq_norms = dict(sq_norms)

    def set_grad_norm_tables(self, measured_norms: Mapping[torch.nn.Parameter, float],
                             sq_norms: Mapping[torch.nn.Parameter, float]) -> None:
        """Where this process holds only its share of the gradients (a node store's split
        update): every parameter's measured norm or precomputed squared norm, gathered
        from the ranks holding them (`ShareReducer.grad_norm_tables`), so the global norm
        is the one-process one bit for bit (`clipping.ordered_total_norm`)."""
        self._forget_gradients()
        self._norm_tables = (dict(measured_norms), dict(sq_norms))

    @property
    def has_grad_norms(self) -> bool:
        """Whether this step's gradient norms were set already (`set_grad_sq_norms`,
        `set_grad_norm_tables`), so a caller setting them again would only throw the
        cached global norm away."""
        return bool(self._precomputed_sq_norms) or self._norm_tables is not None

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm (fp32) of the current gradients, computed once per step.

        Cached until `zero_grad()`, `end_step()` or `set_grad_sq_norms()`: call it after
        the step's last backward.
        """
        if self._grad_norm_cache is None:
            params = [p for group in self.param_groups for p in group["params"]]
            if self._norm_tables is not None:
                self._grad_norm_cache = ordered_total_norm(params, *self._norm_tables)
            else:
                to_measure, known = split_precomputed(params, self._precomputed_sq_norms)
                self._grad_norm_cache = total_grad_norm(to_measure, known)
        return self._grad_norm_cache

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.zero_grad_gate is not None and self.zero_grad_gate(set_to_none):
            return  # each group's gradients are cleared right after its update
        super().zero_grad(set_to_none=set_to_none)
        self._forget_gradients()

    def _forget_gradients(self) -> None:
        self._grad_norm_cache = None
        self._precomputed_sq_norms = {}
        self._norm_tables = None

    # --- the step, whole or per layer ---------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step over every parameter with a gradient (skipped if non-finite);
        on a LazyTrain run, the run's step (`run_step`). torch's own wrapper of this
        method runs the step hooks around either."""
        if self.run_step is not None:
            return self.run_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            if self.begin_step():
                self.step_params([p for group in self.param_groups for p in group["params"]])
            self.end_step()
        return loss

    def begin_step(self, *, check_finite: bool = False) -> bool:
        """Decide this step once: returns False (and counts it) if the norm is not finite.

        The norm is measured when clipping is on, the engine supplied norms, or
        `check_finite` asks for it (the LazyTrain step always does); otherwise there is
        no norm pass, so no finite check (like torch's AdamW).
        """
        if self._context is not None and self._context.apply:
            raise RuntimeError("begin_step() called again before end_step(); finish the "
                               "step in progress with end_step() first")
        group_of = {}
        for group in self.param_groups:
            frozen = {k: v for k, v in group.items() if k != "params"}
            group_of.update(dict.fromkeys(group["params"], frozen))
        self.last_grad_norm = None
        clip_coef = 1.0
        if self.max_grad_norm is not None or self.has_grad_norms or check_finite:
            norm = self.grad_norm()
            self.last_grad_norm = float(norm)
            if not torch.isfinite(norm):
                # A skipped step is complete: callers may stop here (the engine does) or
                # still call step_params (no-op) and end_step; the next begin_step works.
                self.skips.add()
                self._forget_gradients()
                self._context = _StepContext(apply=False, clip_coef=1.0, group_of=group_of)
                return False
            if self.max_grad_norm is not None:
                clip_coef = clip_coefficient(norm, self.max_grad_norm)
        self._context = _StepContext(apply=True, clip_coef=clip_coef, group_of=group_of)
        return True

    def step_params(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        out_bf16: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Update only `params` (same math as step()); a no-op if the step is skipped.

        `out_bf16[i]`, when given, receives the bf16 copy of `params[i]` after its update,
        written in the same pass when it is a contiguous CPU tensor. The update of each
        tensor is dispatched here, one frame above the kernel: this is what the engine's
        update thread calls (tests/frontends/test_one_step.py counts the frames).
        """
        context = self._context
        if context is None:
            raise RuntimeError("step_params() outside a step: call begin_step() first and "
                               "end_step() after the last step_params()")
        if out_bf16 is not None and len(out_bf16) != len(params):
            raise ValueError(f"out_bf16 has {len(out_bf16)} entries for {len(params)} params")
        if not context.apply:
            return
        with torch.no_grad():
            for i, param in enumerate(params):
                if param.grad is None:
                    continue
                master, grad, state, scalars, block_size = self._prepare(context, param)
                out = None if out_bf16 is None else out_bf16[i]
                if "exp_avg" in state:
                    reference.adamw_fp32_update_(master, grad, state, scalars, out_bf16=out)
                elif self._kernel is not None and master.device.type == "cpu":
                    fused_out = out if _writable_in_kernel(out, master) else None
                    self._kernel.adamw8bit_step(
                        master, grad, state["exp_avg_codes"], state["exp_avg_absmax"],
                        state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], fused_out,
                        scalars.beta1, scalars.beta2, scalars.eps, scalars.decay,
                        scalars.step_size, scalars.inv_bias_correction2_sqrt,
                        scalars.clip_coef, block_size)
                    if out is not None and fused_out is None:
                        out.copy_(master.view_as(out))
                elif master.device.type == "cpu":
                    reference.adamw8bit_update_(master, grad, state, scalars,
                                                block_size=block_size, out_bf16=out)
                else:
                    _update_in_chunks(master, grad, state, scalars, block_size, out,
                                      chunk_elements=DEVICE_UPDATE_CHUNK_ELEMENTS)
                if master is not param.data:
                    param.data.copy_(master)
                # written through `.data`: a copy keyed to the parameter's version (the
                # engine's compute copy, `WeightPool`) must see the change
                torch.autograd.graph.increment_version(param)

    def _prepare(self, context: _StepContext, param: torch.nn.Parameter) -> tuple[
            torch.Tensor, torch.Tensor, dict[str, Any], reference.AdamStepScalars, int]:
        """(flat master, flat grad, state, scalars, block size) of `param`'s update in
        this step: its state claimed (created on first use) and its step count advanced.
        Both kernels walk flat memory; a strided master is updated through a copy (the
        caller copies it back)."""
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("HybridAdamW8bit does not support sparse gradients")
        if grad.dtype not in (torch.float32, torch.bfloat16):
            grad = grad.float()
        state = self._claim(context, param)
        group = context.group_of[param]
        _follow_master(state, param.data.device)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        scalars = reference.AdamStepScalars(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], step=int(state["step"]),
            clip_coef=context.clip_coef)
        master = param.data if param.data.is_contiguous() else param.data.contiguous()
        return master, grad.contiguous(), state, scalars, group["block_size"]

    def _claim(self, context: _StepContext, param: torch.nn.Parameter) -> dict[str, Any]:
        """Mark `param` updated in this step and return its state (created on first use),
        under the lock another thread's `step_params` takes too."""
        with self._shared_lock:
            if param not in context.group_of:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in this "
                                 "optimizer's param groups")
            if param in context.updated:
                raise RuntimeError(f"parameter of shape {tuple(param.shape)} was already "
                                   "updated in this step; pass each parameter once")
            context.updated.add(param)
            state = self.state[param]
            if not state:
                _init_state(state, param, context.group_of[param]["block_size"],
                            self.min_8bit_numel)
            return state

    def end_step(self) -> None:
        """Close the step: the cached norm and the engine's norms belong to it."""
        self._context = None
        self._forget_gradients()

    # --- state ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict (any process); 8-bit codes stay uint8 (torch would cast them)."""
        load_state_keeping_codes(self, state_dict, super().load_state_dict)
        check_loaded_state(self)

    @property
    def uses_native_kernel(self) -> bool:
        return self._kernel is not None


def _init_state(state: dict[str, Any], param: torch.Tensor, block_size: int,
                min_8bit_numel: int) -> None:
    state["step"] = torch.zeros((), dtype=torch.float32)
    if param.numel() < min_8bit_numel:
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return
    blocks = num_blocks(param.numel(), block_size)
    for name in ("exp_avg", "exp_avg_sq"):
        state[f"{name}_codes"] = torch.zeros(param.numel(), dtype=torch.uint8, device=param.device)
        state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)


def _follow_master(state: dict[str, Any], device: torch.device) -> None:
    """Keep a parameter's moments on its master's device: the engine may move a master
    between the host and the GPU (`Plan.resident_update`), a checkpoint may load on either."""
    for name, value in state.items():
        if name != "step" and isinstance(value, torch.Tensor) and value.device != device:
            state[name] = value.to(device)


def _update_in_chunks(master: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                      scalars: reference.AdamStepScalars, block_size: int,
                      out: torch.Tensor | None, *, chunk_elements: int) -> None:
    """`reference.adamw8bit_update_` over whole-block slices of at most `chunk_elements`."""
    step = max(chunk_elements // block_size, 1) * block_size
    flat_out = None if out is None else out.view(-1)
    for lo in range(0, master.numel(), step):
        hi = min(lo + step, master.numel())
        blocks = slice(lo // block_size, num_blocks(hi, block_size))
        part = {f"{name}_{kind}": state[f"{name}_{kind}"][lo:hi] if kind == "codes"
                else state[f"{name}_{kind}"][blocks]
                for name in ("exp_avg", "exp_avg_sq") for kind in ("codes", "absmax")}
        reference.adamw8bit_update_(
            master.view(-1)[lo:hi], grad.view(-1)[lo:hi], part, scalars,
            block_size=block_size, out_bf16=None if flat_out is None else flat_out[lo:hi])


def _writable_in_kernel(out: torch.Tensor | None, param: torch.Tensor) -> bool:
    return (out is not None and out.device.type == "cpu" and out.dtype == torch.bfloat16
            and out.is_contiguous() and out.numel() == param.numel())


def _resolve_kernel(backend: str) -> Any:
    if backend == "torch":
        return None
    kernel = native.load_kernel()
    if kernel is None and backend == "native":
        raise RuntimeError("backend='native' but the C++ kernel could not be built (see the "
                           "warning above); install g++ and ninja, or use backend='auto'")
    return kernel


def _check_hyperparameters(*, lr: float, betas: tuple[float, float], eps: float,
                           weight_decay: float) -> None:
    if not lr >= 0:
        raise ValueError(f"lr={lr} must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas={betas} must be two values in [0, 1)")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or not 1 <= block_size <= _MAX_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size!r} must be an int in [1, {_MAX_BLOCK_SIZE}] "
                         "(256 is the tested default)")
