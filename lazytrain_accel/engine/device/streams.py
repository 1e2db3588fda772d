"""Copy streams and events behind one interface, with three backends.

The weight pool, gradient sink, activation store and NVMe spill are written against
`Streams`: `CudaStreams` (one CUDA side stream per PCIe direction, so H2D and D2H overlap
as the simulator assumes; CUDA events, pinned host buffers), `SyncStreams` (the CPU
default: a copy is done when issued, events are None) and `EmulatedStreams`
(`emulation.py`, `LAZYTRAIN_EMULATE_ASYNC=1`: the CUDA code paths on a CPU). `make_streams`
(`backends.py`) picks one; it lives apart so that the emulated backend can import this
interface without this module importing it back. Docs: docs/engine.md "Emulated async device".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Literal, Protocol

import torch

from lazytrain_accel.engine.device.pinning import register_in_chunks
from lazytrain_accel.engine.stats import ElapsedInterval, Interval

#: A side stream, named by the link its copies use.
Link = Literal["h2d", "d2h"]
#: The NVMe links (the spill's I/O thread), throttled and jittered under emulation.
IoLink = Literal["nvme_read", "nvme_write"]


class Event(Protocol):
    """Completion of the work a stream had queued when the event was recorded."""

    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Streams(Protocol):
    """What the engine's parts need from a device: side streams, events, host buffers."""

    device: torch.device
    #: True when copies complete after they are issued: staging buffers and events are
    #: then needed (CUDA, emulation); False when a copy is done when issued (CPU).
    is_async: bool
    #: Tier host staging buffers count against ("host_pinned" or "host_pageable").
    host_tier: str

    def copy_stream(self, link: Link) -> AbstractContextManager[None]:
        """Issue the enclosed copies on `link`'s side stream, after the compute so far."""
        ...

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` on the stream in use (asynchronously on a side stream)."""
        ...

    def record(self) -> Event | None:
        """An event on the stream in use (None when its work is already done)."""
        ...

    def compute_waits(self, event: Event | None) -> None:
        """Make the stream in use (compute, or the side stream inside `copy_stream`) wait
        for `event` without blocking the host."""
        ...

    def host_waits(self, event: Event | None) -> None:
        """Block the host until `event` (e.g. a copy into a host buffer) has completed."""
        ...

    def claim(self, buffer: torch.Tensor) -> None:
        """Declare that the host hands `buffer` (a staging buffer) out again: every copy
        that used it must have been waited for (checked under emulation)."""
        ...

    def empty_host(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: page-locked where DMA needs it, plain memory otherwise."""
        ...

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Inside `copy_stream`: tell the allocator `tensor` is in use by the side stream."""
        ...

    def poison(self, tensor: torch.Tensor) -> None:
        """Mark `tensor` as about to be filled in the background (NaN under emulation)."""
        ...

    def io_link(self, link: IoLink, nbytes: int) -> AbstractContextManager[None]:
        """Bracket one NVMe transfer of `nbytes` on an I/O thread (the spill's, the state's)."""
        ...

    def start_interval(self) -> Callable[[], Interval]:
        """Time the work of the stream in use (a `Clock`: compute outside `copy_stream`,
        the link inside it) where it runs; see `engine/stats.py`."""
        ...

    def register_pinned(self, buffer: torch.Tensor, *, max_chunk_bytes: int) -> bool:
        """Make a host buffer mapped by several processes (a node store) page-locked for
        this device's copies, in chunks of at most `max_chunk_bytes`; False when it could
        not be (copies then run from pageable memory: `engine/device/pinning.py`). True where
        copies need no pinned memory."""
        ...

    def close(self) -> None: ...


class SyncStreams:
    """CPU, synchronous: every copy is done when issued, so no event is ever needed."""

    is_async = False
    host_tier = "host_pageable"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy_stream(self, link: Link) -> AbstractContextManager[None]:
        return nullcontext()

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Event | None:
        return None

    def compute_waits(self, event: Event | None) -> None:
        return None

    def host_waits(self, event: Event | None) -> None:
        return None

    def claim(self, buffer: torch.Tensor) -> None:
        return None

    def empty_host(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        return None

    def poison(self, tensor: torch.Tensor) -> None:
        return None

    def io_link(self, link: IoLink, nbytes: int) -> AbstractContextManager[None]:
        return nullcontext()

    def start_interval(self) -> Callable[[], Interval]:
        start = time.perf_counter()  # the work runs on this thread as it is issued
        return lambda: ElapsedInterval(time.perf_counter() - start)

    def register_pinned(self, buffer: torch.Tensor, *, max_chunk_bytes: int) -> bool:
        return True

    def close(self) -> None:
        return None


class CudaStreams(SyncStreams):
    """A GPU: one side stream per PCIe direction, CUDA events, pinned staging."""

    is_async = True
    host_tier = "host_pinned"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._side = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}

    @contextmanager
    def copy_stream(self, link: Link) -> Iterator[None]:
        side = self._side[link]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self, event: Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_waits(self, event: Event | None) -> None:
        if event is not None:
            event.synchronize()

    def empty_host(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def register_pinned(self, buffer: torch.Tensor, *, max_chunk_bytes: int) -> bool:
        """Page-lock a shared mapping in this process (each rank registers its own
        mapping of the same pages; pinned copies outrun pageable ones: `PAGEABLE_SHARE`
        in `profiling/hardware.py`), in chunks (`engine/device/pinning.py`); False,
        warned once, when it cannot be."""
        cudart = torch.cuda.cudart()
        return register_in_chunks(
            buffer.data_ptr(), buffer.numel() * buffer.element_size(),
            max_chunk_bytes=max_chunk_bytes,
            register=lambda address, nbytes: cudart.cudaHostRegister(
                address, nbytes, 1),  # cudaHostRegisterPortable: every context sees it
            unregister=cudart.cudaHostUnregister, what="the node store")

    def keep_alive(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))

    def start_interval(self) -> Callable[[], Interval]:
        """CUDA events with timing on the stream in use: its execution, not issue, time."""
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))

        def stop() -> Interval:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            return CudaInterval(start, end)

        return stop


class CudaInterval:
    """Two timed CUDA events of one stream."""

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._start, self._end = start, end

    def query(self) -> bool:
        return self._end.query()

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3  # elapsed_time is in ms
