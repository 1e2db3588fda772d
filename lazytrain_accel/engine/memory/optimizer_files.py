"""The fp32 masters and optimizer moments of the layers the plan homes on NVMe
(`Plan.state.optimizer`): a file per layer, read back for the layer's update and written
behind it, so that between updates the host holds none of them.

An *evicted* layer's trainable `.data` and optimizer state tensors (but the step count)
are placeholders of their shape and dtype holding no bytes (stride-0 views of one NaN or
zero; writing into them raises); the device streams the layer's compute copy, keyed by
`generation`. The update *stages* a layer (read ahead into one of `STATE_STAGING_GROUPS`
aligned buffers: `.data` and the state become views of it) and evicts it after (written
behind from the buffer). A file is the layer's parameters in order, each its master then
its state tensors by name, every tensor on a `BLOCK_BYTES` boundary (no bounce copies).
Files go through the engine's `StateIO` as `LayerFiles` into `<NVMe directory>/state`
(one per drive); a failed write or read raises its `StateIOError` at the layer's next use.
Docs: docs/engine.md "Host state on NVMe".
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lazytrain_accel.engine.memory.layer_files import LayerFiles
from lazytrain_accel.engine.memory.state_io import StateIO
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.planning.state import STATE_STAGING_GROUPS
from lazytrain_accel.storage.direct_io import (
    BLOCK_BYTES,
    FileRange,
    StateIOError,
    aligned_empty,
)

#: The optimizer state entries that stay in DRAM (a step count: one number).
KEPT_IN_DRAM = ("step",)

OptimizerState = Mapping[nn.Parameter, dict[str, Any]]


@dataclass(frozen=True)
class _Entry:
    """One tensor of a layer's file: `param`'s master (`name` None) or state `name`."""

    param: nn.Parameter
    name: str | None
    dtype: torch.dtype
    shape: torch.Size
    offset: int  # bytes from the file's start, a multiple of BLOCK_BYTES

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


@dataclass(frozen=True)
class _Layout:
    entries: tuple[_Entry, ...]
    nbytes: int  # the file's length: the last entry's end

    def holds(self, param: nn.Parameter, name: str | None) -> bool:
        return any(e.param is param and e.name == name for e in self.entries)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _layout(params: Sequence[nn.Parameter], state: OptimizerState | None) -> _Layout:
    """Where each master and state tensor of `params` lies in their layer's file."""
    entries, offset = [], 0
    for p in params:
        tensors: list[tuple[str | None, torch.Tensor]] = [(None, p.data)]
        held = state.get(p, {}) if state is not None else {}
        tensors += [(name, value) for name, value in sorted(held.items())
                    if name not in KEPT_IN_DRAM and isinstance(value, torch.Tensor)
                    and value.dim() > 0]
        for name, tensor in tensors:
            entry = _Entry(p, name, tensor.dtype, tensor.shape, offset)
            entries.append(entry)
            offset = _round_up(offset + entry.nbytes)
    end = entries[-1].offset + entries[-1].nbytes if entries else 0
    return _Layout(tuple(entries), end)


def _back_to_back(layout: _Layout, tensors: Sequence[torch.Tensor],
                  pad: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` (contiguous, one per entry of `layout`) flattened, with `pad(n)` bytes
    before each where its offset leaves a gap: the file's bytes in order."""
    pieces: list[torch.Tensor] = []
    position = 0
    for entry, tensor in zip(layout.entries, tensors, strict=True):
        if entry.offset > position:
            pieces.append(pad(entry.offset - position))
        pieces.append(tensor.view(-1))
        position = entry.offset + entry.nbytes
    return pieces


class _Placeholders:
    """Stride-0 tensors of any shape over one element per dtype: NaN for floats, so a
    stray read of an evicted master poisons loudly; none of them can be written."""

    def __init__(self) -> None:
        self._scalars: dict[torch.dtype, torch.Tensor] = {}

    def of(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        scalar = self._scalars.get(dtype)
        if scalar is None:
            fill = float("nan") if dtype.is_floating_point else 0
            scalar = self._scalars[dtype] = torch.full((), fill, dtype=dtype)
        return scalar.expand(shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        scalar = self._scalars.get(tensor.dtype)
        return scalar is not None and tensor.data_ptr() == scalar.data_ptr() \
            and all(s == 0 for s in tensor.stride())


class NvmeMasters:
    """The files of the masters and moments of `layers` (1-based) under `directories` (one
    per drive); `params[j - 1]` are layer j's trainable parameters."""

    def __init__(self, directories: Sequence[Path], layers: set[int],
                 params: list[list[nn.Parameter]], accounting: Accounting, io: StateIO, *,
                 claim_root: Callable[[], None]) -> None:
        #: The layers homed on NVMe now (a re-plan may change them: `set_layers`).
        self.layers = frozenset(layers)
        self._files = LayerFiles(directories, "optim", accounting, io, claim_root=claim_root)
        self._params = params
        self._layer_of = {p: j for j, ps in enumerate(params, start=1) for p in ps}
        self._acct = accounting
        self._placeholders = _Placeholders()
        #: layer -> the layout of its file, while its state lives there (evicted)
        self._evicted: dict[int, _Layout] = {}
        #: layer -> (its buffer, the layout) while staged: `.data` and state are views
        self._staged: dict[int, tuple[torch.Tensor, _Layout]] = {}
        #: layer -> how often its masters were evicted after a change (`generation`)
        self._generations: dict[int, int] = {}
        #: the update's layers still to read, in its order; the reads issued
        self._queue: deque[tuple[int, _Layout]] = deque()
        self._reads: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self._state: OptimizerState | None = None
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # Staging buffers: at most STATE_STAGING_GROUPS; one returns when its write ends
        # (on an I/O thread), hence the condition.
        self._buffers = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._held_bytes = 0  # of all buffers, counted as host_pageable
        self._count = 0

    # ---- what the engine asks ---------------------------------------------------------
    def generation(self, layer: int) -> int | None:
        """A number that changes whenever layer `layer`'s masters may have (for the
        compute copy's key: `WeightPool`); None when its masters live in DRAM for good."""
        if layer in self._evicted or layer in self._staged:
            return self._generations.get(layer, 0)
        return None

    def evict(self, layer: int, state: OptimizerState | None = None, *,
              changed: bool = True) -> None:
        """Write layer `layer`'s masters (and, in `state`, their optimizer state) to its
        file behind and leave placeholders in their place. A staged layer's buffer comes
        back once written; a layer in DRAM (at attach, or homed by a re-plan) is written
        from its own tensors, freed once written. `changed`: its masters may differ from
        its last eviction's (bumps `generation`)."""
        params = self._params[layer - 1]
        if not params or layer in self._evicted:
            return
        if state is not None:
            self._state = state
        state = self._state
        layout = _layout(params, state)
        staged = self._staged.pop(layer, None)
        in_place = staged is not None and self._in_place(staged[0], layout, state)
        # in place: one aligned run, no bounce copy
        tensors = [staged[0][:layout.nbytes]] if in_place else self._pieces(layout, state)
        write = self._files.write(layer, tensors)
        if staged is not None and not in_place:
            # state the optimizer made this step lives beside the buffer until written:
            # one layer's at a time, so the update stays within its planned buffers
            write.exception()
        if staged is not None:
            buffer = staged[0]
            write.add_done_callback(lambda _: self._give_back(buffer))
        write.add_done_callback(lambda _: tensors.clear())  # written: their DRAM is free
        for entry in layout.entries:
            self._place(entry, state, self._placeholders.of(entry.dtype, entry.shape))
        self._evicted[layer] = layout
        if changed:  # its compute copy is stale until keyed to the new generation
            self._generations[layer] = self._generations.get(layer, 0) + 1

    def _in_place(self, buffer: torch.Tensor, layout: _Layout,
                  state: OptimizerState | None) -> bool:
        """Whether every tensor of `layout` is the view of `buffer` at its offset."""
        base = buffer.data_ptr()
        return all(self._tensor(e, state).data_ptr() == base + e.offset
                   and self._tensor(e, state).is_contiguous() for e in layout.entries)

    def _pieces(self, layout: _Layout, state: OptimizerState | None) -> list[torch.Tensor]:
        """The file's bytes as tensors back to back: each entry's tensor, zeros between."""
        pad = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
        return _back_to_back(layout, [self._tensor(e, state).contiguous()
                                      for e in layout.entries], lambda n: pad[:n])

    def restore(self, layer: int, state: OptimizerState | None = None) -> None:
        """Bring layer `layer`'s masters and moments (into `state`, the optimizer's) back
        into DRAM (read now, into tensors of their own): `detach`, a re-plan that no
        longer homes it, a checkpoint's save or load (`StreamingEngine.masters_in_dram`)."""
        if state is not None:
            self._state = state
        layout = self._evicted.get(layer)
        if layout is None:
            self._staged_to_own(layer)
            return
        values = self._read_values(layer, layout)
        del self._evicted[layer]
        for entry in layout.entries:
            self._place(entry, self._state, values[entry.param, entry.name], check=True)
        self._generations.pop(layer, None)

    def in_file(self, param: nn.Parameter, name: str | None) -> int | None:
        """The layer whose file holds `param`'s master (`name` None) or its state `name`
        now, else None (in DRAM: a layer not evicted, or the step count)."""
        layer = self._layer_of.get(param)
        layout = self._evicted.get(layer) if layer is not None else None
        return layer if layout is not None and layout.holds(param, name) else None

    def file_range(self, param: nn.Parameter, name: str | None) -> FileRange | None:
        """Where `param`'s master (`name` None) or its state `name` lies in its layer's
        file, once that file's last write is on the drive (a checkpoint copies it from
        there, file to file); None where it is in DRAM."""
        layer = self.in_file(param, name)
        if layer is None:
            return None
        entry = next(e for e in self._evicted[layer].entries
                     if e.param is param and e.name == name)
        self._files.wait_written(layer)
        return FileRange(self._files.path(layer), entry.offset, entry.nbytes, entry.dtype)

    def read_values(self, layer: int) -> dict[tuple[nn.Parameter, str | None], torch.Tensor]:
        """Layer `layer`'s masters (name None) and state tensors by (parameter, name), read
        from its file into tensors of their own, leaving the layer evicted; {} for a layer
        whose state is not in its file."""
        layout = self._evicted.get(layer)
        return {} if layout is None else self._read_values(layer, layout)

    def _read_values(self, layer: int, layout: _Layout
                     ) -> dict[tuple[nn.Parameter, str | None], torch.Tensor]:
        tensors = [torch.empty(e.shape, dtype=e.dtype) for e in layout.entries]
        pieces = _back_to_back(layout, tensors,
                               lambda n: torch.empty(n, dtype=torch.uint8))
        self._files.read(layer, pieces).result()
        return {(e.param, e.name): t for e, t in zip(layout.entries, tensors, strict=True)}

    def _staged_to_own(self, layer: int) -> None:
        """A staged layer's tensors copied out of its buffer, which goes back."""
        staged = self._staged.pop(layer, None)
        if staged is None:
            return
        buffer, layout = staged
        for entry in layout.entries:
            self._place(entry, self._state, self._tensor(entry, self._state).clone())
        self._give_back(buffer)
        self._generations.pop(layer, None)

    def stage(self, layer: int, state: OptimizerState | None = None) -> None:
        """Point layer `layer`'s masters and moments at a buffer holding them (read ahead,
        or now), until `evict`; nothing for a layer in DRAM."""
        if state is not None:
            self._state = state
        layout = self._evicted.get(layer)
        if layout is None:
            return
        with self._buffers:
            if layer not in self._reads:  # not read yet: first in line for a buffer
                self._queue = deque([(layer, layout), *(e for e in self._queue
                                                        if e[0] != layer)])
                while layer not in self._reads:
                    if not self._read_ahead():
                        self._buffers.wait()  # until a write gives a buffer back
            buffer, read = self._reads.pop(layer)
        try:
            read.result()
        except BaseException:
            self._give_back(buffer)
            raise
        del self._evicted[layer]
        self._staged[layer] = (buffer, layout)
        for entry in layout.entries:
            view = buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype)
            self._place(entry, self._state, view.view(entry.shape), check=True)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.state_dict()` hold the values of the evicted layers' state (read
        from their files) instead of placeholders; once per optimizer."""
        if optimizer in self._watched:
            return
        self._watched.add(optimizer)

        def with_files(opt: torch.optim.Optimizer, packed: dict[str, Any]) -> dict[str, Any]:
            params = [p for g in opt.param_groups for p in g["params"]]
            by_layer: dict[int, list[int]] = {}
            for index in packed["state"]:
                layer = self._layer_of.get(params[index])
                if layer is not None and layer in self._evicted:
                    by_layer.setdefault(layer, []).append(index)
            for layer, indices in by_layer.items():
                values = self.read_values(layer)
                for index in indices:
                    packed["state"][index] = {
                        name: values.get((params[index], name), value)
                        for name, value in packed["state"][index].items()}
            return packed

        optimizer.register_state_dict_post_hook(with_files)

    def module_hook(self, module: nn.Module, layer: int) -> Callable[..., None]:
        """A `state_dict` post-hook for decoder layer `layer`'s `module`: its evicted
        masters' values, read from the file, in place of placeholders (not where the
        caller asked for the parameters themselves, `keep_vars=True`)."""
        names = {p: name for name, p in module.named_parameters()}

        def with_files(_: nn.Module, state_dict: dict[str, Any], prefix: str,
                       local_metadata: Any) -> None:
            if layer not in self._evicted:
                return
            values = self.read_values(layer)
            for p in self._params[layer - 1]:
                key = prefix + names[p]
                if key in state_dict and not isinstance(state_dict[key], nn.Parameter):
                    state_dict[key] = values[p, None]

        return with_files

    # ---- the update ------------------------------------------------------------------
    def begin_update(self, order: Sequence[int], state: OptimizerState) -> None:
        """The update is about to run groups `order` with the optimizer's `state`: start
        reading the first evicted ones' files."""
        self._state = state
        with self._buffers:
            self._queue = deque((j, self._evicted[j]) for j in order if j in self._evicted)
        self._read_ahead()

    def after_update(self, layer: int) -> None:
        """Layer `layer` was updated: evict it where homed (staged, or in DRAM since a
        re-plan homed it) and read the next one ahead."""
        if layer in self.layers and layer not in self._evicted:
            self.evict(layer)
        self._read_ahead()

    def end_update(self) -> None:
        """The update ended (done, or failed part way): no read stays in flight, no homed
        layer stays staged."""
        with self._buffers:
            self._queue.clear()
            reads, self._reads = self._reads, {}
        for buffer, read in reads.values():
            read.exception()
            self._give_back(buffer)
        for layer in list(self._staged):
            if layer in self.layers:
                self.evict(layer)

    def set_layers(self, layers: Iterable[int]) -> None:
        """Home `layers` from now: those evicted and no longer homed come back to DRAM;
        the newly homed are evicted after their next update."""
        self.layers = frozenset(layers)
        for layer in sorted(set(self._evicted) - self.layers):
            self.restore(layer)

    @property
    def evicted_layers(self) -> list[int]:
        return sorted(self._evicted)

    def wait_written(self, layer: int) -> None:
        """Block until layer `layer`'s last write is on the drive; raise its error."""
        self._files.wait_written(layer)

    def close(self) -> None:
        """Every layer back in DRAM, the files removed, the buffers freed; a layer whose
        file cannot be read back (its write failed) is named in the error raised after."""
        lost: list[tuple[int, BaseException]] = []
        try:
            self.end_update()
        except StateIOError as err:  # a staged layer's write: read back below, or lost
            lost.append((0, err))
        for layer in sorted(set(self._evicted) | set(self._staged)):
            try:
                self.restore(layer)
            except StateIOError as err:
                lost.append((layer, err))
        try:
            self._files.close()
        except StateIOError as err:
            lost.append((0, err))
        with self._buffers:
            self._free.clear()
            self._count = 0
        if self._held_bytes:
            self._acct.free("host_pageable", self._held_bytes)
            self._held_bytes = 0
        layers = sorted({layer for layer, _ in lost if layer})
        if lost:
            raise RuntimeError(
                f"the masters and moments of layers {layers or '?'} homed on NVMe could not "
                f"be read back ({lost[0][1]}); the files are removed: resume from the last "
                "checkpoint") from lost[0][1]

    # ---- tensors, buffers ------------------------------------------------------------
    def _tensor(self, entry: _Entry, state: OptimizerState | None) -> torch.Tensor:
        if entry.name is None:
            return entry.param.data
        return state[entry.param][entry.name]

    def _place(self, entry: _Entry, state: OptimizerState | None, tensor: torch.Tensor, *,
               check: bool = False) -> None:
        """Make `tensor` the master (or state tensor) of `entry`; `check`: what it replaces
        must be the placeholder an eviction left (else it was changed behind the file)."""
        if entry.name is None:
            current = entry.param.data
        else:
            if state is None or entry.param not in state:
                raise RuntimeError(
                    f"the optimizer state of a parameter of shape {tuple(entry.shape)} lives "
                    "on NVMe but no optimizer state was given to bring it back: step the "
                    "optimizer that trained it (or load its checkpoint) before reading it")
            current = state[entry.param].get(entry.name)
        if check and (current is None or not self._placeholders.holds(current)):
            what = "master" if entry.name is None else f"optimizer state {entry.name!r}"
            raise RuntimeError(
                f"the {what} of a parameter of shape {tuple(entry.shape)} was replaced while "
                "it lived on NVMe (its tensor is not the engine's placeholder): change the "
                "masters through the engine (StreamingEngine.staged_masters), or plan "
                "without host state on NVMe")
        if entry.name is None:
            entry.param.data = tensor
        else:
            state[entry.param][entry.name] = tensor

    def _read_ahead(self) -> bool:
        """Issue reads for the queued layers, in order, while a buffer is free or may be
        made (whether any was): from the update thread, and from the I/O thread whose
        write gave one back (so the next read follows that write on the drive, as the
        planner prices it)."""
        issued = False
        with self._buffers:
            while self._queue and (self._free or self._count < STATE_STAGING_GROUPS):
                self._issue(*self._queue.popleft())
                issued = True
            if issued:
                self._buffers.notify_all()  # a stage waiting for its layer's read
        return issued

    def _issue(self, layer: int, layout: _Layout) -> None:
        """Read layer `layer`'s file into a free (or new) buffer once its last write is
        done; never blocks (an I/O thread may call it). Called holding `_buffers`."""
        buffer = self._take(layout.nbytes)
        read: Future[None] = Future()
        self._reads[layer] = (buffer, read)

        def start() -> None:
            try:
                started = self._files.read(layer, [buffer[:layout.nbytes]])
            except BaseException as err:  # its last write failed: the read's error
                read.set_exception(err)
                return
            started.add_done_callback(lambda done: read.set_exception(done.exception())
                                      if done.exception() is not None
                                      else read.set_result(None))

        self._files.when_written(layer, start)

    def _take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least `nbytes`, or a new one while fewer than the bound
        exist (the caller checked that one of the two holds)."""
        with self._buffers:
            buffer = self._free.pop() if self._free else None
            if buffer is None:
                self._count += 1
            if buffer is not None and buffer.numel() >= nbytes:
                return buffer
            if buffer is not None:  # too small for this layer's file: replaced
                self._held_bytes -= buffer.numel()
                self._acct.free("host_pageable", buffer.numel())
            buffer = aligned_empty(_round_up(nbytes), torch.uint8)
            self._held_bytes += buffer.numel()
            self._acct.allocate("host_pageable", buffer.numel())
            return buffer

    def _give_back(self, buffer: torch.Tensor) -> None:
        """`buffer` is free (its write ended, on an I/O thread, or its layer went back to
        DRAM): the next queued read takes it."""
        with self._buffers:
            self._free.append(buffer)
            if not self._read_ahead():
                self._buffers.notify_all()
