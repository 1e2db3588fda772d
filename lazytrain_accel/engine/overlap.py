"""Optimizer/forward overlap: a layer-by-layer update on a CPU thread.

Groups are updated in forward order (group 0 = resident parameters, group j = layer j);
the next forward of layer j waits only for group j. `optimizer.zero_grad()` and
`model.zero_grad()` called while the update runs are deferred per group: a group's
gradients are cleared right after its update, never before, so a prompt `zero_grad()`
cannot erase gradients still unread. (Both are patched on the instance for the duration
of the update; a `zero_grad` bound before `step_layerwise` bypasses the deferral.)
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch import nn

from lazytrain_accel.engine.stats import Accounting


class LayerwiseUpdate:
    def __init__(self, optimizer: Any, model: nn.Module, groups: list[list[nn.Parameter]],
                 accounting: Accounting) -> None:
        self._opt = optimizer
        self._patched = (optimizer, model)
        self._groups = groups
        self._acct = accounting
        self._done = [threading.Event() for _ in groups]
        self._lock = threading.Lock()
        self._zero: bool | None = None  # set_to_none of a deferred zero_grad, if any
        self._error: BaseException | None = None
        for owner in self._patched:  # instance patches, removed when the update ends
            owner.__dict__["zero_grad"] = self._deferred_zero_grad
        self._thread = threading.Thread(target=self._run, name="lazytrain-step", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for group, done in zip(self._groups, self._done, strict=True):
                if group:
                    self._opt.step_params(group)
                with self._lock:
                    if self._zero is not None:
                        _zero(group, self._zero)
                    done.set()
            self._opt.end_step()
        except BaseException as err:  # surfaced on the training thread by wait()
            self._error = err
        finally:
            with self._lock:
                for owner in self._patched:
                    owner.__dict__.pop("zero_grad", None)
                for done in self._done:
                    done.set()

    def _deferred_zero_grad(self, set_to_none: bool = True) -> None:
        with self._lock:
            self._zero = set_to_none
            for group, done in zip(self._groups, self._done, strict=True):
                if done.is_set():
                    _zero(group, set_to_none)

    def is_ready(self, group: int) -> bool:
        return self._done[group].is_set()

    def wait(self, group: int | None = None) -> None:
        """Block until `group` (None: every group) is updated; re-raise a thread error."""
        start = time.perf_counter()
        if group is None:
            self._thread.join()
        else:
            self._done[group].wait()
        self._acct.add("stall_s", time.perf_counter() - start)
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the layer-wise optimizer update failed") from err


def _zero(params: list[nn.Parameter], set_to_none: bool) -> None:
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.zero_()
