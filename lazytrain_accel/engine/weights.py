"""Double-buffered device weight pool: a layer's compute copy lives here while it runs.

Masters stay where `param.data` points when a layer is idle (host, fp32). To run layer j
its parameters' `.data` are swapped to views of a device slot holding the compute-dtype
copy, and swapped back afterwards. Two slots: the running layer and the prefetched next.
With an async backend (CUDA, or its CPU emulation) a master goes master -> pinned staging
(dtype cast on the host) -> slot on the H2D side stream, so only two layers' worth of pinned
memory exist, never a pinned model copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.engine.streams import Event, Streams

NUM_SLOTS = 2


class WeightPool:
    def __init__(self, layer_params: list[list[nn.Parameter]], *, streams: Streams,
                 compute_dtype: torch.dtype, accounting: Accounting,
                 is_ready: Callable[[int], bool], wait_ready: Callable[[int], None]) -> None:
        self._params = layer_params  # index 0 = layer 1
        self._dtype = compute_dtype
        self._streams = streams
        self._acct = accounting
        self._is_ready = is_ready
        self._wait_ready = wait_ready
        numel = max((sum(p.numel() for p in ps) for ps in layer_params), default=0)
        device = streams.device
        self._slots = [torch.empty(numel, dtype=compute_dtype, device=device)
                       for _ in range(NUM_SLOTS)]
        self._staging = [streams.empty_host(torch.Size([numel]), compute_dtype)
                         for _ in range(NUM_SLOTS)] if streams.is_async else []
        self._staging_free: list[Event | None] = [None] * NUM_SLOTS
        self._slot_layer: list[int | None] = [None] * NUM_SLOTS
        self._slot_loaded: list[Event | None] = [None] * NUM_SLOTS
        self._slot_done: list[Event | None] = [None] * NUM_SLOTS
        self._last_used = [0] * NUM_SLOTS
        self._clock = 0
        self._acquired: dict[int, tuple[int, list[torch.Tensor]]] = {}
        slot_bytes = numel * self._slots[0].element_size()
        accounting.allocate("device", NUM_SLOTS * slot_bytes)
        if self._staging:
            accounting.allocate("host_pinned", NUM_SLOTS * slot_bytes)
        self._slot_bytes = slot_bytes

    def invalidate(self) -> None:
        """Forget loaded copies: the masters may have been updated by an optimizer step."""
        self._slot_layer = [None] * NUM_SLOTS

    def prefetch(self, layer: int) -> None:
        """Start loading `layer` (1-based) if its master is final; never blocks the host."""
        if layer in self._slot_layer or not 1 <= layer <= len(self._params):
            return
        if self._is_ready(layer):
            self._load(layer)

    def acquire(self, layer: int) -> None:
        """Point `layer`'s parameters at their device copy (loading it now if needed)."""
        if layer not in self._slot_layer:
            start = time.perf_counter()
            self._wait_ready(layer)
            self._load(layer)
            self._acct.add("stall_s", time.perf_counter() - start)
        slot = self._slot_layer.index(layer)
        self._streams.compute_waits(self._slot_loaded[slot])
        params = self._params[layer - 1]
        masters = [p.data for p in params]
        for p, view in zip(params, self._views(slot, params), strict=True):
            p.data = view
        self._acquired[layer] = (slot, masters)
        self._clock += 1
        self._last_used[slot] = self._clock

    def release(self, layer: int) -> None:
        """Point `layer`'s parameters back at their host masters."""
        slot, masters = self._acquired.pop(layer)
        for p, master in zip(self._params[layer - 1], masters, strict=True):
            p.data = master
        self._slot_done[slot] = self._streams.record()

    def _views(self, slot: int, params: list[nn.Parameter]) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in params:
            views.append(self._slots[slot][offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    def _pick_slot(self) -> int:
        busy = {slot for slot, _ in self._acquired.values()}
        free = [s for s in range(NUM_SLOTS) if s not in busy]
        if not free:
            raise RuntimeError("all weight slots are in use: the engine runs one layer at a "
                               "time; a layer was acquired twice without release")
        return min(free, key=lambda s: self._last_used[s])

    def _load(self, layer: int) -> None:
        slot = self._pick_slot()
        params = self._params[layer - 1]
        nbytes = sum(p.numel() for p in params) * self._slots[slot].element_size()
        with self._acct.timed_transfer("weights_h2d", nbytes):
            if self._streams.is_async:
                self._load_async(slot, params)
            else:
                for p, view in zip(params, self._views(slot, params), strict=True):
                    view.copy_(p.data)
        self._slot_layer[slot] = layer
        self._clock += 1
        self._last_used[slot] = self._clock

    def _load_async(self, slot: int, params: list[nn.Parameter]) -> None:
        streams, staging, offset = self._streams, self._staging[slot], 0
        streams.host_waits(self._staging_free[slot])  # previous H2D from this staging done
        streams.claim(staging)
        for p in params:
            staging[offset:offset + p.numel()].view(p.shape).copy_(p.data)
            offset += p.numel()
        with streams.copy_stream("h2d"):
            streams.compute_waits(self._slot_done[slot])  # slot's last reader done
            streams.copy_(self._slots[slot][:offset], staging[:offset])
            event = streams.record()
        self._slot_loaded[slot] = event
        self._staging_free[slot] = event

    def close(self) -> None:
        self._acct.free("device", NUM_SLOTS * self._slot_bytes)
        if self._staging:
            self._acct.free("host_pinned", NUM_SLOTS * self._slot_bytes)
        self._slots, self._staging = [], []
