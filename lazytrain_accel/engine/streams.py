"""Copy streams and events: a CUDA side stream when the device is a GPU, no-ops on CPU.

Everything above this file is written against `Streams`, so the CPU test suite runs the
same code paths that overlap copies with compute on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Streams:
    """The compute stream and one side stream for host<->device copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._copy = torch.cuda.Stream(device) if self.is_cuda else None

    @contextmanager
    def copy_stream(self) -> Iterator[None]:
        """Run copies on the side stream, after the work queued so far on compute."""
        if self._copy is None:
            yield
            return
        self._copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event on the stream currently in use (None on CPU: work is already done)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for `event` without blocking the host."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def host_waits(event: torch.cuda.Event | None) -> None:
        """Block the host until `event` (a copy into a host buffer) has completed."""
        if event is not None:
            event.synchronize()

    def empty_host(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: page-locked on CUDA (async DMA), plain memory on CPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    @property
    def host_tier(self) -> str:
        """Tier that host staging buffers count against."""
        return "host_pinned" if self.is_cuda else "host_pageable"

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator `tensor` is in use by the side stream too."""
        if self._copy is not None and tensor.is_cuda:
            tensor.record_stream(self._copy)
