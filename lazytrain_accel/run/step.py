"""`OptimizerStep`: what `optimizer.step()` is on a LazyTrain run, top-down in one place.

`OptimizerStep.__call__` reads like torchtitan's `train_step`: wait for the previous
update, the norms of the landed gradients (once), the finite check and the clip
coefficient (once, `HybridAdamW8bit.begin_step`), the peers' step begins and the update
launches (`StepCoordinator.update`: layer by layer on the engine's thread, or inline),
then the guard's record of the step (`StepGuard.record`: the limit of a streak) and the
step-boundary hooks (accelerate's `_is_overflow`, the re-planner, Ctrl-C). A skipped step
is counted once, by what decided it, in the run's one `SkipCount` (`optim/skip_count.py`:
`begin_step` counts the hybrid operator's; this step counts a kept optimizer's).
docs/architecture.md "One optimizer step" walks the frames from `optimizer.step()` to the
kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from types import MethodType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lazytrain_accel.optim import HybridAdamW8bit
from lazytrain_accel.run.step_guard import StepGuard

if TYPE_CHECKING:
    from lazytrain_accel.engine.step.coordinator import StepCoordinator


class SteppedEngine(Protocol):
    """What the step needs of the engine (`StreamingEngine`)."""

    steps: StepCoordinator

    def grad_sq_norms(self) -> dict[nn.Parameter, float]: ...


class ShareNorms(Protocol):
    """Every rank's shares of the gradients where each rank holds only its own (a node
    store's `ShareReducer`): each call a collective, made by every rank at the same point."""

    def grad_norm_tables(self) -> tuple[dict[nn.Parameter, float],
                                        dict[nn.Parameter, float]]: ...

    def global_grad_sq_norm(self) -> float: ...


#: Where a skipped step's bad gradient was when this rank's share of it is finite.
OTHER_RANKS = "a parameter another rank owns"


def update_overlaps(setting: bool | str, *, device: torch.device, emulated: bool) -> bool:
    """Whether the hybrid update runs on its thread beside the next forward
    (`LazyTrainConfig.overlap_step`). "auto" does so where the device computes apart from
    the host's cores (a GPU, the emulated async device, which proves that path); on a
    CPU device the compute takes every core (`threads.py`) and the update beside it only
    oversubscribes them: the overlapped step measured 1.09x the serial one on a 2-core
    Xeon (`bench/step_overlap.py`, docs/benchmarks.md "The plan at prepare")."""
    if setting == "auto":
        return device.type != "cpu" or emulated
    return bool(setting)


class OptimizerStep:
    """`optimizer.step()` of one optimizer of a LazyTrain run (`install` puts it there).

    With `HybridAdamW8bit` the step is decided and launched here; any other optimizer
    ("keep") steps through its own `step`, after the guard let the step through.
    `overlapped`: the update runs layer by layer on the engine's thread and `step()`
    returns at once (else inline). `engine` is None once the engine is detached: the
    step then runs inline on the optimizer alone. `shares`: a node store's reducer, the
    other ranks' shares of the gradients, which the global norm (hybrid) and the finite
    check ("keep") read (None: this rank holds every gradient).
    """

    def __init__(self, *, guard: StepGuard, engine: SteppedEngine | None,
                 overlapped: bool, shares: ShareNorms | None = None) -> None:
        self.guard = guard
        self.engine = engine
        self.overlapped = overlapped
        self.shares = shares
        #: Told at each step boundary whether the step was skipped (the Accelerator tells
        #: accelerate, so LR schedulers and the Trainer do not count a skipped step, and
        #: lets the re-planner switch plans).
        self.on_boundary: Callable[[bool], None] | None = None
        self._own_step: Callable[..., Any] | None = None  # a "keep" optimizer's step

    def install(self, optimizer: torch.optim.Optimizer,
                replaced: torch.optim.Optimizer | None = None) -> None:
        """Make this `optimizer.step`, once, at prepare. The hybrid operator's own `step`
        calls it (`HybridAdamW8bit.run_step`), inside torch's wrapper that runs the step
        hooks; any other optimizer's `step` is replaced on the instance by a function
        bound to it (LR schedulers re-bind `step.__func__`). `replaced`: the user's
        optimizer that `optimizer` replaced (never stepped)."""
        previous = optimizer.step  # a bound method, or a scheduler's wrapper around it
        if isinstance(optimizer, HybridAdamW8bit):
            if self.engine is not None:  # its zero_grad() reaches the engine from now
                self.engine.steps.adopt(optimizer)
            self.guard.count_in(optimizer.skips)  # it decides and counts the skips
            optimizer.run_step = self
        else:
            self._own_step = previous

            def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
                return self(opt, *args, **kwargs)
            # a scheduler built before prepare checks that its wrapper is still there
            if getattr(previous, "_wrapped_by_lr_sched", False):
                step._wrapped_by_lr_sched = True
            optimizer.step = MethodType(step, optimizer)
        optimizer._lazytrain_step = self
        if replaced is not None and replaced is not optimizer:
            # A scheduler built on the replaced optimizer checks at its first step that
            # its wrapper of that optimizer's `step` ran (torch's `_opt_called`), which
            # is never called now: a post-hook sets the mark (docs/architecture.md
            # "Patched points").
            optimizer.register_step_post_hook(partial(_mark_stepped, replaced))

    def __call__(self, optimizer: torch.optim.Optimizer,
                 closure: Callable[[], float] | None = None) -> Any:
        """One optimizer step, top-down; with the overlap it returns while the update runs."""
        hybrid = isinstance(optimizer, HybridAdamW8bit)
        loss = None
        if hybrid and closure is not None:
            with torch.enable_grad():
                loss = closure()
        steps = self.engine.steps if self.engine is not None else None
        if steps is not None:
            steps.wait()  # the previous step's update, whole
            steps.check_backward_done()
        if hybrid and not optimizer.has_grad_norms:  # clip_grad_norm_ may have set them
            self.set_norms(optimizer)
        bad = self._nonfinite(optimizer, hybrid)  # finite check and clip coefficient, once
        if bad is None:
            # partial, not a lambda: no frame of its own between the step and the kernel
            inline = partial(_update_whole, optimizer) if hybrid else partial(
                self._own_step, closure)
            if steps is None:
                result = inline()
            else:  # the peers' step begins; the update launches (or runs inline)
                result = steps.update(optimizer, None if hybrid and self.overlapped
                                      else inline)
            loss = loss if hybrid else result  # a "keep" optimizer ran the closure itself
        elif steps is not None:
            steps.skip()
        self.guard.record(bad)  # raises at a streak's limit
        if self.on_boundary is not None:
            self.on_boundary(bad is not None)
        self.guard.stop_if_interrupted()  # Ctrl-C: stop at this boundary
        return loss

    def set_norms(self, optimizer: HybridAdamW8bit) -> None:
        """The norms of this step's gradients, once, for the hybrid operator's clip and
        finite check: every rank's shares' (a node store: the one-process norm, bit for
        bit), else the engine's, measured as the gradients landed (neither: it measures
        them). `clip_grad_norm_` sets them through here too."""
        if self.shares is not None:
            optimizer.set_grad_norm_tables(*self.shares.grad_norm_tables())
        elif self.engine is not None:
            optimizer.set_grad_sq_norms(self.engine.grad_sq_norms())

    def _nonfinite(self, optimizer: torch.optim.Optimizer, hybrid: bool) -> str | None:
        """None if the step applies, else where its gradients went non-finite; a skipped
        step is counted once, here. With the hybrid operator its `begin_step` decides
        (global norm, then clip coefficient) and counts; the guard only names the first
        bad parameter of a skipped step."""
        if hybrid:
            if optimizer.begin_step(check_finite=True):
                return None
            return self.guard.first_nonfinite() or OTHER_RANKS
        # the shares first: a collective every rank joins, whatever its own share holds
        finite = self.shares is None or math.isfinite(self.shares.global_grad_sq_norm())
        bad = self.guard.first_nonfinite() or (None if finite else OTHER_RANKS)
        if bad is not None:
            self.guard.skips.add()  # a kept optimizer does not decide: the step counts it
        return bad


def _mark_stepped(replaced: torch.optim.Optimizer, *_: Any) -> None:
    """A step post-hook: what an LR scheduler's wrapper of `replaced.step` sets."""
    replaced._opt_called = True


def _update_whole(optimizer: HybridAdamW8bit) -> None:
    optimizer.step_params([p for group in optimizer.param_groups for p in group["params"]])
    optimizer.end_step()


def installed_step(optimizer: torch.optim.Optimizer) -> OptimizerStep | None:
    """The `OptimizerStep` installed on `optimizer`, if any."""
    return getattr(optimizer, "_lazytrain_step", None)

