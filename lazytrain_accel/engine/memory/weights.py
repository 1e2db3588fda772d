"""Double-buffered device weight pool: a layer's compute copy lives here while it runs.

Masters stay where `param.data` points when a layer is idle (host, fp32); to run layer j
its parameters' `.data` point at views of a device slot holding the compute-dtype copy.
Two slots, three when the plan recomputes; which slot a load takes is
`planning/slots.py:WeightSlots`, the policy the simulator runs too. On an async backend a
master goes through one of two pinned staging buffers (the cast on the host) to its slot
on the H2D side stream: never a pinned copy of the model. Below fp32 the layer-wise update
writes each layer's compute copy (`compute_copy`), and loads stream from it while its
masters are the same tensors at the same version; a layer whose masters another node
holds streams the copy received from it (`receive_copies`); a node store's ranks stream
a layer whose masters live on its owner's drive from the store's copy, which the owner's
update writes (`NodeCopies`).
Docs: docs/engine.md "Execution model" (**Weights**).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from lazytrain_accel.engine.device.streams import Event, Streams
from lazytrain_accel.engine.memory.copy_files import NvmeCopies
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.planning.slots import WeightSlots
from lazytrain_accel.storage.direct_io import aligned_empty
from lazytrain_accel.storage.flat import flat_views

NUM_STAGING = 2  # pinned staging buffers, used in turn


@dataclass(frozen=True, kw_only=True)
class NodeCopies:
    """Compute copies in memory the processes of a node share (the node store's, for the
    layers whose masters and moments the plan homes on NVMe: `distributed/node_store.py`),
    each flat in its layer's parameters' order. This process updates `updated_here` of
    them: their masters live in its own files, and its update writes their copy in place.
    The others it streams as their owners write them: their masters are placeholders here."""

    copies: Mapping[int, torch.Tensor]
    updated_here: frozenset[int]

    @property
    def foreign(self) -> frozenset[int]:
        """The layers another process updates."""
        return frozenset(self.copies) - self.updated_here


def master_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of `param`'s host master: fp32 for a trainable floating-point parameter
    (the update runs on fp32 masters), its stored dtype otherwise (frozen weights stay as
    stored). `attach` casts the masters to it and the node store lays its segment out by
    it (`distributed/node_store.py`, whose layout hash depends on the two agreeing)."""
    return torch.float32 if param.requires_grad and param.is_floating_point() else param.dtype


class WeightPool:
    def __init__(self, layer_params: list[list[nn.Parameter]], *, streams: Streams,
                 compute_dtype: torch.dtype, accounting: Accounting,
                 is_ready: Callable[[int], bool], wait_ready: Callable[[int], None],
                 num_slots: int = 2, nvme_copies: NvmeCopies | None = None) -> None:
        self._params = layer_params  # index 0 = layer 1
        #: `masters_generation(layer)`: for a layer whose masters live on NVMe (the
        #: engine's `NvmeMasters.generation`), the number that keys its compute copy in
        #: place of its masters' tensors; None for a layer whose masters are in DRAM
        self.masters_generation: Callable[[int], int | None] = lambda layer: None
        self._dtype = compute_dtype
        self._streams = streams
        self._acct = accounting
        self._is_ready = is_ready
        self._wait_ready = wait_ready
        self._numel = max((sum(p.numel() for p in ps) for ps in layer_params), default=0)
        self._slot_bytes = self._numel * torch.empty((), dtype=compute_dtype).element_size()
        self._slots: list[torch.Tensor] = []
        self._policy = WeightSlots(0)  # which layer each slot holds, which slot loads take
        self._slot_loaded: list[Event | None] = []
        self._slot_done: list[Event | None] = []
        self.grow(num_slots)
        self._staging = [streams.empty_host(torch.Size([self._numel]), compute_dtype)
                         for _ in range(NUM_STAGING)] if streams.is_async else []
        self._staging_free: list[Event | None] = [None] * NUM_STAGING
        self._next_staging = 0
        self._acquired: dict[int, tuple[int, list[torch.Tensor]]] = {}
        if self._staging:
            accounting.allocate("host_pinned", NUM_STAGING * self._slot_bytes)
        self._copies: list[torch.Tensor | None] = [None] * len(layer_params)
        self._copy_keys: list[tuple[tuple[int, int], ...] | None] = [None] * len(layer_params)
        #: The layers whose copies live on NVMe between their uses (`Plan.state.copies`):
        #: their DRAM buffer is dropped after each load and read back for the next, in the
        #: backward one load ahead (`_reads`: layer -> buffer and its read).
        self._nvme = nvme_copies
        self._reads: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        #: Which masters' version each layer's file holds (a buffer is dropped only when
        #: its file holds the same: a layer homed there by a re-plan may have none yet)
        self._file_keys: dict[int, tuple[tuple[int, int], ...]] = {}
        self._backward = False
        #: (slot, layer) -> the layer's parameters as views of the slot, made at the first
        #: use of the pair: a dozen views cost ~0.1 ms of host time at each load on a CPU
        self._slot_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        #: layer -> its compute copy as another node sends it (the split layout: no master
        #: of it here), streamed as it is (`receive_copies`)
        self._received: dict[int, torch.Tensor] = {}
        #: the layers whose `_copies` buffer is memory shared with other processes, which
        #: this one's update writes (`share_copies`): never dropped, never freed here
        self._shared: set[int] = set()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def grow(self, num_slots: int) -> None:
        """Have at least `num_slots` device slots (a new plan may recompute)."""
        while len(self._slots) < num_slots:
            self._slots.append(torch.empty(self._numel, dtype=self._dtype,
                                           device=self._streams.device))
            self._slot_loaded.append(None)
            self._slot_done.append(None)
            self._acct.allocate("device", self._slot_bytes)
        self._policy.grow(num_slots)

    def forget_all_but(self, layer: int) -> None:
        """Forget the loaded layers other than `layer` (the last forward layer): the
        backward loads its layers anew, in its own order, as the planner counts them."""
        self._policy.forget_all_but(layer)
        self._backward = True
        self._read_ahead(layer - 1)  # the backward's first load

    def invalidate(self) -> None:
        """Forget loaded copies: the masters may have been updated by an optimizer step."""
        self._policy.invalidate()
        self._backward = False

    def prefetch(self, layer: int) -> None:
        """Start loading `layer` (1-based) if its master is final and a slot holds nothing
        still to be used; never blocks the host. A layer loaded already is kept until it
        runs again."""
        if self._policy.keep(layer) is not None or not 1 <= layer <= len(self._params):
            return
        if self._is_ready(layer) and self._pick_slot(for_prefetch=True) is not None:
            self._load(layer)

    def load(self, layer: int) -> None:
        """Start loading `layer` now unless a slot holds it or is loading it: the layer
        about to run, whose load goes ahead of any prefetch. A slot holding it is kept
        from the prefetches issued before it runs (B_L on F_L's copy, a re-run layer's
        backward on its re-run's)."""
        if self._policy.keep(layer) is None:
            self._wait_ready(layer)  # an optimizer wait is accounted by the update itself
            self._load(layer)

    def acquire(self, layer: int) -> None:
        """Point `layer`'s parameters at their device copy (loading it now if needed);
        the compute stream waits for the load (on the emulated device the host does)."""
        self.load(layer)
        slot = self._policy.ran(layer)
        with self._acct.stalled():  # blocks the host where compute is the host's thread
            self._streams.compute_waits(self._slot_loaded[slot])
        params = self._params[layer - 1]
        masters = [p.data for p in params]
        for p, view in zip(params, self._views(slot, layer), strict=True):
            p.data = view
        self._acquired[layer] = (slot, masters)

    def release(self, layer: int) -> None:
        """Point `layer`'s parameters back at their host masters."""
        slot, masters = self._acquired.pop(layer)
        for p, master in zip(self._params[layer - 1], masters, strict=True):
            p.data = master
        self._slot_done[slot] = self._streams.record()

    def _views(self, slot: int, layer: int) -> list[torch.Tensor]:
        views = self._slot_views.get((slot, layer))
        if views is None:
            views = self._slot_views[slot, layer] = flat_views(self._slots[slot],
                                                           self._params[layer - 1])
        return views

    def _pick_slot(self, *, for_prefetch: bool) -> int | None:
        """The slot a load takes (`WeightSlots.pick`), not one a running layer uses; for a
        prefetch None when every free slot holds a layer still to run."""
        slot = self._policy.pick(busy={s for s, _ in self._acquired.values()},
                                 for_prefetch=for_prefetch)
        if slot is None and not for_prefetch:
            raise RuntimeError("all weight slots are in use: the engine runs one layer at a "
                               "time; a layer was acquired twice without release")
        return slot

    def _load(self, layer: int) -> int:
        """Load `layer` into the slot `_pick_slot` gives (returned)."""
        slot = self._pick_slot(for_prefetch=False)
        assert slot is not None
        params = self._params[layer - 1]
        nbytes = sum(p.numel() for p in params) * self._slots[slot].element_size()
        copy = self._fresh_copy(layer)
        if self._streams.is_async:  # timed on the H2D stream (`_copy_to_slot`)
            self._load_async(slot, params, copy, nbytes)
        else:
            with self._acct.timed_transfer("weights_h2d", nbytes):
                if copy is not None:
                    self._slots[slot][:copy.numel()].copy_(copy)
                else:
                    for p, view in zip(params, self._views(slot, layer), strict=True):
                        view.copy_(p.data)
        self._policy.filled(slot, layer)
        self._drop_nvme_copy(layer)  # copied out above: back to its file until the next load
        if self._backward:
            self._read_ahead(layer - 1)  # the backward's next load
        return slot

    def _load_async(self, slot: int, params: list[nn.Parameter],
                    copy: torch.Tensor | None, nbytes: int) -> None:
        k = self._next_staging
        self._next_staging = (k + 1) % NUM_STAGING
        streams, staging, offset = self._streams, self._staging[k], 0
        with self._acct.stalled():
            streams.host_waits(self._staging_free[k])  # previous H2D from this staging done
        streams.claim(staging)
        with self._acct.host_work("weights_stage", nbytes):
            if copy is not None:  # the update's compute copy: a plain memcpy, no cast
                offset = copy.numel()
                staging[:offset].copy_(copy)
            for p in params if copy is None else ():
                staging[offset:offset + p.numel()].view(p.shape).copy_(p.data)
                offset += p.numel()
        event = self._copy_to_slot(slot, self._slots[slot][:offset], staging[:offset],
                                   nbytes=nbytes)
        self._staging_free[k] = event

    def _copy_to_slot(self, slot: int, dst: torch.Tensor, staging: torch.Tensor, *,
                      nbytes: int) -> Event:
        """Copy `staging` into `dst` (part of `slot`) on the H2D side stream once the slot's
        last reader is done, timed there as `nbytes` of weights; the slot's load event
        (returned) covers this copy and every earlier one on that stream."""
        streams = self._streams
        with streams.copy_stream("h2d"):
            streams.compute_waits(self._slot_done[slot])  # slot's last reader done
            with self._acct.timed_transfer("weights_h2d", nbytes):
                streams.copy_(dst, staging)
            event = streams.record()
        self._slot_loaded[slot] = event
        return event

    # ---- compute copies written by the optimizer update -------------------------------
    def compute_copy(self, layer: int, params: Sequence[nn.Parameter] | None = None
                     ) -> list[torch.Tensor] | None:
        """Views for the update to write the compute-dtype copy into, one per parameter of
        `params` (default: every parameter of `layer`; an optimizer of a LoRA updates its
        adapters only); None when there is nothing to cast (fp32 compute). Called on the
        update thread before `layer` is updated: a stale copy is first refreshed from the
        masters, so parameters the update skips (frozen, no gradient) are right too."""
        if self._dtype == torch.float32 or not 1 <= layer <= len(self._params) \
                or layer in self._received:
            return None
        wanted, params = params, self._params[layer - 1]
        # a copy in its file is not read back: the masters it was cast from are as valid
        valid = self._copy_keys[layer - 1] == self._master_key(layer) \
            and self._copies[layer - 1] is not None
        self._copy_keys[layer - 1] = None  # being rewritten: not to be streamed
        if self._nvme is not None:
            self._nvme.wait_written(layer)  # its last write read this buffer
            self._forget_read(layer)  # a read ahead of a copy about to be rewritten
        if self._copies[layer - 1] is None:
            self._copies[layer - 1] = self._new_copy(layer)
        views = flat_views(self._copies[layer - 1], params)
        if not valid:
            for p, view in zip(params, views, strict=True):
                view.copy_(p.data)
        if wanted is None:
            return views
        view_of = dict(zip(params, views, strict=True))
        return [view_of[p] for p in wanted]

    def compute_copy_written(self, layer: int) -> None:
        """The update has written `layer`'s copy from its new masters: stream from it (and
        where the plan homes it on NVMe, write it to its file behind)."""
        copy = self._copies[layer - 1]
        if copy is not None:
            self._copy_keys[layer - 1] = self._master_key(layer)
            if self._nvme is not None and layer in self._nvme.layers:
                self._nvme.write(layer, copy)
                self._file_keys[layer] = self._copy_keys[layer - 1]

    def receive_copies(self, copies: Mapping[int, torch.Tensor]) -> None:
        """Stream the layers of `copies` from them too: each its compute copy, flat in the
        order of its parameters, which another process writes (the split layout's
        exchange, `exchanged_copy`; a node store's owner, `NodeCopies`) where no master of
        it lives in this one."""
        self._check_copies(copies)
        self._received.update(copies)

    def share_copies(self, copies: Mapping[int, torch.Tensor]) -> None:
        """Keep the compute copies of the layers of `copies` in them: memory shared with
        other processes, which this one's update writes and the others stream
        (`NodeCopies.updated_here`)."""
        self._check_copies(copies)
        for layer, copy in copies.items():
            self._copies[layer - 1] = copy
            self._copy_keys[layer - 1] = None  # cast from the masters before it streams
            self._shared.add(layer)

    def _check_copies(self, copies: Mapping[int, torch.Tensor]) -> None:
        for layer, copy in copies.items():
            numel = sum(p.numel() for p in self._params[layer - 1])
            if copy.dtype != self._dtype or copy.numel() != numel:
                raise ValueError(f"layer {layer}'s given copy is {copy.numel()} "
                                 f"{copy.dtype}, the layer {numel} {self._dtype}")

    def received_views(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter of the layers received as compute copies (`receive_copies`) with
        its view in its layer's copy: where a checkpoint's weights load on this node."""
        return {p: view for layer, copy in self._received.items()
                for p, view in zip(self._params[layer - 1],
                                   flat_views(copy, self._params[layer - 1]), strict=True)}

    def exchanged_copy(self, layer: int) -> torch.Tensor | None:
        """`layer`'s whole compute copy, flat, for the split layout's exchange: the copy
        this rank receives into (`receive_copies`), or the one to send, its update's (cast
        from the masters here where an update of all layers at once wrote none); None at
        fp32 compute (the masters are sent instead)."""
        if layer in self._received:
            return self._received[layer]
        if self._dtype == torch.float32:
            return None
        if self._copies[layer - 1] is None \
                or self._copy_keys[layer - 1] != self._master_key(layer):
            self.compute_copy(layer)
            self.compute_copy_written(layer)
        return self._copies[layer - 1]

    def home_copies(self, layers: set[int]) -> None:
        """Home the copies of `layers` on NVMe from their next update (a new plan)."""
        if self._nvme is not None:
            self._nvme.layers = frozenset(layers)
        elif layers:
            raise ValueError("this run keeps no compute copies (fp32): none to home on NVMe")

    def _new_copy(self, layer: int) -> torch.Tensor:
        numel = sum(p.numel() for p in self._params[layer - 1])
        # aligned: its file's writes and reads move without a bounce buffer's copy
        copy = aligned_empty(numel, self._dtype)
        self._acct.allocate("host_pageable", numel * copy.element_size())
        return copy

    def _fresh_copy(self, layer: int) -> torch.Tensor | None:
        """`layer`'s copy if it is its masters' (read back from its file where the plan
        homes it on NVMe and its buffer was dropped), else None."""
        if layer in self._received:  # written by the exchange before the layer is ready
            return self._received[layer]
        key = self._copy_keys[layer - 1]
        if key is None or key != self._master_key(layer):
            if self.masters_generation(layer) is not None:
                raise RuntimeError(
                    f"layer {layer}'s masters live on NVMe but its compute copy is not "
                    "theirs: the engine refreshes the copy whenever it changes them; "
                    "change masters through StreamingEngine.staged_masters")
            return None
        if self._copies[layer - 1] is None and self._nvme is not None:
            self._read_ahead(layer)  # unless one was started ahead
            copy, read = self._reads.pop(layer)
            with self._acct.stalled():
                read.result()
            self._copies[layer - 1] = copy
        return self._copies[layer - 1]

    def _read_ahead(self, layer: int) -> None:
        """Start reading `layer`'s copy back from its file if it is there (valid, its
        buffer dropped) and no read of it runs yet."""
        if (self._nvme is None or not 1 <= layer <= len(self._params) or layer in self._reads
                or self._copies[layer - 1] is not None
                or self._copy_keys[layer - 1] != self._master_key(layer)):
            return
        copy = self._new_copy(layer)
        self._reads[layer] = copy, self._nvme.read(layer, copy)

    def _forget_read(self, layer: int) -> None:
        """Wait for and free a read of `layer`'s copy nobody will use."""
        pending = self._reads.pop(layer, None)
        if pending is not None:
            copy, read = pending
            read.exception()  # finished either way; its buffer is not used
            self._acct.free("host_pageable", copy.numel() * copy.element_size())

    def _drop_nvme_copy(self, layer: int) -> None:
        """Let go of the DRAM buffer of a copy the plan homes on NVMe whose file holds (or
        is being written) the same version: its write in flight keeps it until done (the
        forward never waits for it; a read back waits for the write), its bytes counted
        until then."""
        copy = self._copies[layer - 1]
        if copy is None or self._nvme is None or layer not in self._nvme.layers \
                or self._copy_keys[layer - 1] is None \
                or self._file_keys.get(layer) != self._copy_keys[layer - 1]:
            return
        self._copies[layer - 1] = None
        nbytes = copy.numel() * copy.element_size()
        self._nvme.when_written(layer, lambda: self._acct.free("host_pageable", nbytes))

    def close(self) -> None:
        for layer, copy in enumerate(self._copies, start=1):
            if copy is not None and layer not in self._shared:
                self._acct.free("host_pageable", copy.numel() * copy.element_size())
        self._copies = [None] * len(self._params)
        if self._nvme is not None:
            for layer in list(self._reads):
                self._forget_read(layer)
            self._nvme.close()
        self._acct.free("device", len(self._slots) * self._slot_bytes)
        if self._staging:
            self._acct.free("host_pinned", NUM_STAGING * self._slot_bytes)
        self._slots, self._staging = [], []
        self._slot_views.clear()

    def _master_key(self, layer: int) -> object:
        """Which masters `layer`'s compute copy was cast from: their generation where they
        live on NVMe, else which tensors, at which version, they are now."""
        generation = self.masters_generation(layer)
        params = self._params[layer - 1]
        if generation is not None:  # the frozen weights beside them stay in DRAM
            return generation, tuple((p.data.data_ptr(), p._version) for p in params
                                     if not p.requires_grad)
        return tuple((p.data.data_ptr(), p._version) for p in params)

