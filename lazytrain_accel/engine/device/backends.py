"""`make_streams`: which `Streams` backend (`streams.py`, `emulation.py`) a device gets."""

from __future__ import annotations

import torch

from lazytrain_accel.engine.device.emulation import EmulatedStreams, EmulationSettings
from lazytrain_accel.engine.device.streams import CudaStreams, Streams, SyncStreams


def make_streams(device: torch.device,
                 emulation: EmulationSettings | bool | None = None) -> Streams:
    """The backend for `device`. `emulation`: None reads `LAZYTRAIN_EMULATE_ASYNC` (and
    its seed) from the environment, False forces the synchronous CPU backend, settings
    emulate. A CUDA device always gets `CudaStreams` (the emulation is for CPU runs)."""
    if device.type == "cuda":
        return CudaStreams(device)
    if emulation is None:
        emulation = EmulationSettings.from_env()
    if emulation is None or emulation is False:
        return SyncStreams(device)
    if emulation is True:
        emulation = EmulationSettings()
    return EmulatedStreams(device, emulation)
