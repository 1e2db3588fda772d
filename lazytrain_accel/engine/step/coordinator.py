"""`StepCoordinator`: one optimizer step of a streamed model, from begin to end.

`update` launches the update of a step that `run/step.py:OptimizerStep` let through
(`step`: the engine's own step for callers without a run) on the run's one
`UpdateWorker`; the coordinator also answers the next forward's waits per group
(`wait_for_group`, `is_group_updated`), the wait for the whole update (`wait`) and the
deferral of `zero_grad()`. Groups run in forward order (0: input residents, j: layer j,
L+1: output residents); residents whose masters live on the device are updated by the
training thread, beside the worker where the device is async (`Streams.is_async`),
before it on a synchronous CPU. docs/engine.md "Step overlap".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from lazytrain_accel.engine.memory.grad_files import NvmeGrads
from lazytrain_accel.engine.memory.optimizer_files import NvmeMasters
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.engine.step.overlap import (
    CopyTarget,
    LayerwiseOptimizer,
    LayerwiseUpdate,
    RemoteUpdates,
    exchanged_copy,
)
from lazytrain_accel.engine.step.worker import UpdateWorker


class SaveGate(Protocol):
    """A checkpoint being written beside training (`checkpoints/asynchronous.py`)."""

    def wait_written(self, group: int) -> None: ...


class PeerUpdates(Protocol):
    """Other local ranks' updates of the groups this rank does not own (node store)."""

    @property
    def foreign_groups(self) -> list[int]: ...

    def begin_step(self) -> None: ...

    def publish(self, group: int) -> None: ...

    def publish_all(self) -> None: ...

    def is_ready(self, group: int) -> bool: ...

    def wait(self, group: int) -> None: ...

    def wait_all(self) -> None: ...


class StepCoordinator:
    """Begin, wait and end of each optimizer step of one streamed model."""

    def __init__(self, *, groups: Sequence[Sequence[nn.Parameter]],
                 device_groups: Sequence[int], copies: CopyTarget,
                 accounting: Accounting, device_update_beside_host: bool,
                 grad_sq_norms: Callable[[], Mapping[nn.Parameter, float]],
                 awaiting_backward: Callable[[], bool]) -> None:
        self._groups = [list(g) for g in groups]  # forward order, every parameter
        #: The groups whose masters live on the device (the residents with
        #: `Plan.resident_update="device"`): the training thread updates them.
        self._device_groups = list(device_groups)
        self._copies = copies
        self._acct = accounting
        #: Whether the residents' device update runs beside the host's layer update.
        self.device_update_beside_host = device_update_beside_host
        self._grad_sq_norms = grad_sq_norms
        self._awaiting_backward = awaiting_backward
        self._update: LayerwiseUpdate | None = None
        self._worker = UpdateWorker()
        #: Set by a node store's split update: the groups other ranks own and update.
        self.peers: PeerUpdates | None = None
        #: Set by the split layout across nodes: the groups another node updates, whose
        #: new weights this rank receives, and the sending of those this rank updates.
        self.remote: RemoteUpdates | None = None
        #: Set while a checkpoint save runs beside training: the update of group g first
        #: waits until the save has written g (`checkpoints/asynchronous.py`).
        self.save_gate: SaveGate | None = None
        #: The files of the gradients the plan homes on NVMe (the engine's `GradSink`'s):
        #: the update reads each back for its layer; a skipped step drops them.
        self.grad_files: NvmeGrads | None = None
        #: The files of the masters and moments the plan homes on NVMe: the update reads
        #: each back for its layer and writes it behind.
        self.master_files: NvmeMasters | None = None

    @property
    def update_groups(self) -> list[list[nn.Parameter]]:
        """Every parameter by group, in update order (0: input residents, j: layer j,
        L+1: output residents)."""
        return [list(g) for g in self._groups]

    @property
    def device_groups(self) -> list[int]:
        """The groups whose masters live on the device (updated by the training thread)."""
        return list(self._device_groups)

    # ---- the step ----------------------------------------------------------------------
    def step(self, optimizer: LayerwiseOptimizer) -> bool:
        """The engine's own step, for callers without a run (the layer probe, benches,
        engine tests): returns when the update is under way (False: skipped). Under the
        LazyTrain Accelerator `optimizer.step()` is `run/step.py:OptimizerStep`, which
        calls `wait`, `check_backward_done` and `update` itself."""
        self.wait()  # the previous step's update, whole
        self.check_backward_done()
        optimizer.set_grad_sq_norms(self._grad_sq_norms())  # measured as gradients landed
        if not optimizer.begin_step():  # global norm -> clip coefficient, once
            self.skip()
            return False  # non-finite: the optimizer skipped and counted the step
        self.update(optimizer)
        return True

    def skip(self) -> None:
        """This step is skipped (non-finite): its gradients homed on NVMe are dropped, as
        the caller's `zero_grad()` drops the others."""
        if self.grad_files is not None:
            self.grad_files.discard()

    def update(self, optimizer: LayerwiseOptimizer,
               inline: Callable[[], object] | None = None) -> object:
        """The update of a step that was let through: layer by layer in forward order on
        the update thread (started here; the residents whose masters live on the device
        on this thread), and this returns at once; or `inline()`, the whole update on
        this thread (its result is returned). The node store's peers learn of the step
        here (the one call of their `begin_step`), and of each group once updated."""
        in_files = self._state_in_files()
        wait_here = inline is not None and bool(in_files)
        if wait_here:
            if not hasattr(optimizer, "step_params"):
                raise ValueError(
                    f"the plan homes {in_files} on NVMe, which only the hybrid 8-bit "
                    f"operator reads back layer by layer; {type(optimizer).__name__} steps "
                    "every parameter at once: use optimizer='hybrid8bit', or plan with "
                    "host_state='copies'")
            inline = None  # read back group by group: the layer-wise update, waited for
        peers = self.peers
        if peers is not None:
            peers.begin_step()  # every rank applies the same steps (global norm)
        if inline is not None:
            result = inline()
            if self.remote is not None:  # in forward order, as the layer-wise update
                groups = self._owned_groups(optimizer)
                transfers = [self.remote.start(g, group, exchanged_copy(
                    self._copies, self.remote, g, len(groups))
                    if self.remote.exchanges(g) else None) for g, group in enumerate(groups)]
                for transfer in transfers:
                    if transfer is not None:
                        transfer.wait()
            if peers is not None:
                peers.publish_all()
            return result
        groups = self._owned_groups(optimizer)
        if self.master_files is not None and isinstance(optimizer, torch.optim.Optimizer):
            self.master_files.watch(optimizer)  # its state_dict() reads the files
        device_groups = self._device_groups
        device_done = threading.Event()
        if not self.device_update_beside_host:
            self._update_on_device(optimizer, groups, device_groups, device_done, fail=None)
        self.adopt(optimizer)
        self._update = LayerwiseUpdate(optimizer, groups, self._acct,
                                       copies=self._copies, device_groups=device_groups,
                                       device_update_done=device_done,
                                       foreign_groups=peers.foreign_groups if peers else (),
                                       on_group_done=peers.publish if peers else None,
                                       before_group=self._wait_for_save(),
                                       grads=self.grad_files, masters=self.master_files,
                                       remote=self.remote)
        self._worker.submit(self._update.run)
        if self.device_update_beside_host:
            self._update_on_device(optimizer, groups, device_groups, device_done,
                                   fail=self._update)
        if wait_here:
            self.wait_for_reads()
        return None

    def _state_in_files(self) -> str:
        """What of this step's update lives in files (the parts, their layers), or ''."""
        parts = []
        if self.grad_files is not None and self.grad_files.pending:
            parts.append(f"gradients (layers {sorted(self.grad_files.layers)})")
        if self.master_files is not None and self.master_files.evicted_layers:
            parts.append(f"masters and moments (layers {self.master_files.evicted_layers})")
        return " and ".join(parts)

    def adopt(self, optimizer: LayerwiseOptimizer) -> None:
        """An optimizer with a `zero_grad_gate` (the hybrid operator) defers its
        `zero_grad()` to this coordinator while an update runs, and drops the gradients
        in files with it: set at prepare (`run/step.py`) or its first step here, and
        again if another engine's coordinator held it."""
        gate = getattr(optimizer, "zero_grad_gate", False)
        if gate is not False and gate != self.defer_zero_grad:
            optimizer.zero_grad_gate = self.defer_zero_grad

    def defer_zero_grad(self, set_to_none: bool) -> bool:
        """A `zero_grad()` of the model or the optimizer: True if the running update took
        it over (each group cleared right after its update), False if none runs; then
        the gradients homed on NVMe are dropped as well."""
        update = self._update
        if update is not None and update.defer_zero_grad(set_to_none):
            return True
        if self.grad_files is not None:
            self.grad_files.discard()
        return False

    def wait_for_reads(self) -> None:
        """Block until this rank's running update (if any) is whole, its error raised;
        the step stays running for `wait` (which also waits for the peers)."""
        if self._update is not None:
            self._update.wait()

    def close(self) -> None:
        """Wait for the running update, then end the update worker's thread."""
        self.wait()
        self._worker.close()

    def _wait_for_save(self) -> Callable[[int], None] | None:
        gate = self.save_gate
        return None if gate is None else gate.wait_written

    def check_backward_done(self) -> None:
        if self._awaiting_backward():
            raise RuntimeError("optimizer.step() called while a forward still awaits its "
                               "backward; call it after loss.backward()")

    def _owned_groups(self, optimizer: LayerwiseOptimizer) -> list[list[nn.Parameter]]:
        """Each group's parameters that `optimizer` updates (a LoRA optimizer owns few)."""
        owned = {p for group in optimizer.param_groups for p in group["params"]}
        return [[p for p in group if p in owned] for group in self._groups]

    def _update_on_device(self, optimizer: LayerwiseOptimizer,
                          groups: list[list[nn.Parameter]], device_groups: list[int],
                          done: threading.Event, *, fail: LayerwiseUpdate | None) -> None:
        """The device residents' update on this thread (on a GPU: queued on the compute
        stream ahead of the next forward); `done` lets the update thread end the step.
        On an error, `fail` (the update thread, if started) is waited for first, and a
        step that never started its thread is closed, so the next one can begin."""
        try:
            if device_groups:
                wait_for_save = self._wait_for_save()
                for j in device_groups if wait_for_save is not None else ():
                    wait_for_save(j)
                with self._acct.timed("device_update_s"):
                    optimizer.step_params([p for j in device_groups for p in groups[j]])
                for j in device_groups if self.remote is not None else ():
                    # (split, CPU "device": another node's residents updated there, sent)
                    transfer = self.remote.start(j, groups[j])
                    if transfer is not None:
                        transfer.wait()
                for j in device_groups if self.peers is not None else ():
                    self.peers.publish(j)  # masters on a CPU "device" are the shared ones
        except BaseException:
            done.set()
            if fail is not None:
                fail.wait()  # no thread left running untracked; then the error
            else:
                optimizer.end_step()
            raise
        done.set()

    # ---- waits of the next step ---------------------------------------------------------
    @property
    def update_pending(self) -> bool:
        """Whether a started update has not been waited for whole yet."""
        return self._update is not None

    def is_group_updated(self, group: int) -> bool:
        """Whether `group` (0: input residents, j: layer j, L+1: output residents) may be
        read: no update runs, or it has reached past that group (and, on a node store,
        its owner has updated it)."""
        local = self._update is None or self._update.is_ready(group)
        return local and (self.peers is None or self.peers.is_ready(group))

    def wait_for_group(self, group: int) -> None:
        """Block until `group` is updated (the next forward needs only that group)."""
        if self._update is not None:
            self._update.wait(group)
        if self.peers is not None:
            self.peers.wait(group)

    def wait(self) -> None:
        """Block until the running update (if any) is whole, and the other ranks' of
        their shares; re-raise its error."""
        if self._update is not None:
            update, self._update = self._update, None
            update.wait()
        if self.peers is not None:
            self.peers.wait_all()
