"""Optimizer/forward overlap: a layer-by-layer update (`LayerwiseUpdate`, one job of the
run's `UpdateWorker`, launched and waited for by `coordinator.py:StepCoordinator`).

Groups are updated in forward order: group 0 = the input side's residents, group j =
layer j, group L+1 = the output side's. The next forward of layer j waits only for group
j. Where the compute dtype is not fp32 the update also writes each layer's compute-dtype
copy (`CopyTarget`, the weight pool). A `zero_grad()` while the update runs is deferred
per group (`defer_zero_grad`): a group's gradients are cleared right after its update,
never before. docs/engine.md "Optimizer/forward overlap".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lazytrain_accel.engine.stats import Accounting


class LayerwiseOptimizer(Protocol):
    """What `StepCoordinator.step` needs of an optimizer (HybridAdamW8bit)."""

    param_groups: list[dict[str, Any]]
    state: Mapping[nn.Parameter, dict[str, Any]]

    def set_grad_sq_norms(self, sq_norms: Mapping[nn.Parameter, float]) -> None: ...

    def begin_step(self) -> bool: ...

    def step_params(self, params: Sequence[nn.Parameter], *,
                    out_bf16: Sequence[torch.Tensor | None] | None = None) -> None: ...

    def end_step(self) -> None: ...


class CopyTarget(Protocol):
    """Where the update writes each layer's compute-dtype copy (the weight pool)."""

    def compute_copy(self, layer: int, params: Sequence[nn.Parameter] | None = None
                     ) -> list[torch.Tensor] | None: ...

    def compute_copy_written(self, layer: int) -> None: ...

    def exchanged_copy(self, layer: int) -> torch.Tensor | None: ...


class StagedGrads(Protocol):
    """Gradients the update reads back from files, layer by layer (`NvmeGrads`)."""

    def begin_update(self, order: Sequence[int]) -> None: ...

    def stage(self, layer: int) -> None: ...

    def unstage(self, layer: int) -> None: ...

    def end_update(self) -> None: ...


class StagedMasters(Protocol):
    """Masters and moments the update reads back from files, layer by layer
    (`NvmeMasters`)."""

    def begin_update(self, order: Sequence[int],
                     state: Mapping[nn.Parameter, dict[str, Any]]) -> None: ...

    def stage(self, layer: int) -> None: ...

    def after_update(self, layer: int) -> None: ...

    def end_update(self) -> None: ...


class Transfer(Protocol):
    """A group's weights under way between nodes (`node_exchange.Exchange`)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> None: ...


class RemoteUpdates(Protocol):
    """Groups updated on another node, whose new weights this rank receives, and those
    this rank updates and sends (the split layout's `NodeExchange`)."""

    def is_remote(self, group: int) -> bool: ...

    def exchanges(self, group: int) -> bool: ...

    @property
    def sends_copies(self) -> bool: ...

    def start(self, group: int, params: Sequence[nn.Parameter],
              copy: torch.Tensor | None = None) -> Transfer | None: ...


class LayerwiseUpdate:
    """The host's update of `groups` in forward order: `run` is the job the caller hands
    to the run's `UpdateWorker` (`StepCoordinator.update`, one frame below the step:
    tests/frontends/test_one_step.py).

    `device_groups` are updated by the training thread instead (`StepCoordinator`), which
    sets `device_update_done` when it has; the thread ends the step (`end_step`) only then.
    `foreign_groups` are updated by another process (a node store's split update): this
    thread neither updates them nor writes their compute copies. `on_group_done(g)` is
    told after this thread has updated group g; `before_group(g)` is called before, and
    may block: a pending checkpoint save has not yet written group g's masters and state
    (`checkpoints/asynchronous.py`), which the update is about to overwrite. `grads`
    holds the gradients of the layers homed on NVMe: read back for each one's update
    (ahead, in this order) and dropped after it; `masters` the masters and moments of
    those homed there: read back before (ahead, in this order), written back after, before
    the compute copy the update wrote is keyed to them. `remote`: under the split
    layout, a group another node updates is received from it instead (started when
    reached, landed in order as it arrives: between this thread's own groups, and at the
    end), and one this rank updates is sent to the other nodes after its update, so the
    nodes update their parts side by side (`RemoteUpdates.start`).
    """

    def __init__(self, optimizer: LayerwiseOptimizer,
                 groups: list[list[nn.Parameter]], accounting: Accounting,
                 copies: CopyTarget | None = None,
                 device_groups: Sequence[int] = (),
                 device_update_done: threading.Event | None = None,
                 foreign_groups: Sequence[int] = (),
                 on_group_done: Callable[[int], None] | None = None,
                 before_group: Callable[[int], None] | None = None,
                 grads: StagedGrads | None = None,
                 masters: StagedMasters | None = None,
                 remote: RemoteUpdates | None = None) -> None:
        self._opt = optimizer
        self._remote = remote
        self._grads = grads
        self._masters = masters
        self._before_group = before_group
        self._foreign_groups = frozenset(foreign_groups)
        self._on_group_done = on_group_done
        self._device_groups = frozenset(device_groups)
        self._device_update_done = device_update_done
        self._groups = groups
        self._acct = accounting
        self._copies = copies
        self._done = [threading.Event() for _ in groups]
        self._lock = threading.Lock()
        self._zero: bool | None = None  # set_to_none of a deferred zero_grad, if any
        self._error: BaseException | None = None
        self._finished = threading.Event()

    def run(self) -> None:
        """The update, whole; an error is kept for the training thread's next `wait`."""
        start = time.perf_counter()
        waited_s = 0.0  # for a checkpoint's gate or the state's reads: not the update's own
        grads, masters = self._grads, self._masters
        try:
            order = [j for j in range(len(self._groups)) if self._updates(j)
                     and not (self._remote is not None and self._remote.is_remote(j))]
            staged_groups = set(order)  # updated here (not received from another node)
            if masters is not None:
                masters.begin_update(order, self._opt.state)
            if grads is not None:
                grads.begin_update(order)
            receiving: deque[tuple[int, Transfer | None]] = deque()  # from other nodes
            sending: list[Transfer] = []
            for index, group in enumerate(self._groups):
                if self._updates(index):
                    wait_start = time.perf_counter()
                    if self._before_group is not None:
                        self._before_group(index)
                    if index not in staged_groups:  # its weights from the node updating it
                        waited_s += time.perf_counter() - wait_start
                        receiving.append((index, self._remote.start(
                            index, group, self._exchanged_copy(index))))
                        self._land(receiving, block=False)
                        continue  # landed as it arrives
                    if masters is not None:
                        masters.stage(index)
                    if grads is not None:
                        grads.stage(index)
                    waited_s += time.perf_counter() - wait_start
                    copy = self._compute_copy(index)
                    if group or copy is not None:  # the optimizer's own frame: the kernel's caller
                        self._opt.step_params(group, out_bf16=copy)
                    if grads is not None:
                        grads.unstage(index)
                    if masters is not None:
                        masters.after_update(index)
                    if copy is not None:
                        self._copies.compute_copy_written(index)
                    if self._remote is not None:
                        transfer = self._remote.start(index, group, self._exchanged_copy(index))
                        sending += [transfer] if transfer is not None else []
                    if self._on_group_done is not None:
                        self._on_group_done(index)
                self._set_done(index)
                self._land(receiving, block=False)
            wait_start = time.perf_counter()
            self._land(receiving, block=True)
            for transfer in sending:
                transfer.wait()
            waited_s += time.perf_counter() - wait_start
            if self._device_update_done is not None:
                self._device_update_done.wait()
            self._opt.end_step()
        except BaseException as err:  # surfaced on the training thread by wait()
            self._error = err
        finally:
            if grads is not None:
                grads.end_update()
            if masters is not None:
                masters.end_update()
            with self._lock:
                for done in self._done:
                    done.set()
            self._acct.add("optimizer_update_s", time.perf_counter() - start - waited_s)
            self._finished.set()

    def _set_done(self, index: int) -> None:
        """Group `index` may be read: its deferred `zero_grad()` applied, its waiters let
        through."""
        with self._lock:
            if self._zero is not None:
                _zero(self._groups[index], self._zero)
            self._done[index].set()

    def _land(self, receiving: deque[tuple[int, Transfer | None]], *, block: bool) -> None:
        """Finish the groups received from other nodes, in order, that have arrived (all
        of them when `block`): their compute copy refreshed from the new masters, their
        owner's publication made, their waiters let through."""
        while receiving and (block or receiving[0][1] is None
                             or receiving[0][1].is_completed()):
            index, transfer = receiving.popleft()
            if transfer is not None:  # (None: none of this optimizer's parameters in it)
                transfer.wait()
            copy = self._compute_copy(index)  # stale now: refreshed from the new masters
            if copy is not None:
                self._copies.compute_copy_written(index)
            if self._on_group_done is not None:
                self._on_group_done(index)
            self._set_done(index)

    def _updates(self, index: int) -> bool:
        """Whether this thread updates group `index` (not another process's, nor one the
        training thread updates on the device)."""
        return index not in self._foreign_groups and index not in self._device_groups

    def _exchanged_copy(self, index: int) -> torch.Tensor | None:
        return exchanged_copy(self._copies, self._remote, index, len(self._groups))

    def _compute_copy(self, index: int) -> list[torch.Tensor] | None:
        """Where the compute-dtype copy of group `index`'s parameters this optimizer
        updates goes (decoder layers only), one view each, if any."""
        layer = 0 < index < len(self._groups) - 1  # a decoder layer (not a resident group)
        if self._copies is None or not layer:
            return None
        return self._copies.compute_copy(index, self._groups[index])

    def defer_zero_grad(self, set_to_none: bool = True) -> bool:
        """A `zero_grad()` during the update: clear the updated groups' gradients now and
        each other group's right after its update. False once the update has ended (the
        caller clears them itself)."""
        with self._lock:
            if self._finished.is_set():
                return False
            self._zero = set_to_none
            for group, done in zip(self._groups, self._done, strict=True):
                if done.is_set():
                    _zero(group, set_to_none)
            return True

    def is_ready(self, group: int) -> bool:
        return self._done[group].is_set()

    def wait(self, group: int | None = None) -> None:
        """Block until `group` (None: every group) is updated; re-raise a thread error."""
        start = time.perf_counter()
        if group is None:
            self._finished.wait()
        else:
            self._done[group].wait()
        waited_s = time.perf_counter() - start
        self._acct.add("stall_s", waited_s)
        self._acct.add("optimizer_wait_s", waited_s)
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the layer-wise optimizer update failed") from err


def exchanged_copy(copies: CopyTarget | None, remote: RemoteUpdates, index: int,
                   num_groups: int) -> torch.Tensor | None:
    """Group `index`'s whole compute copy (of `num_groups`) where `remote` (the split
    layout) sends or receives it in place of its masters (decoder layers, where no node
    holds every master: below fp32 compute with copies the update writes), else None."""
    layer = 0 < index < num_groups - 1  # a decoder layer (not a resident group)
    if copies is None or not layer or not remote.sends_copies:
        return None
    return copies.exchanged_copy(index)


def _zero(params: list[nn.Parameter], set_to_none: bool) -> None:
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.zero_()
