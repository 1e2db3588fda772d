"""What a layer re-run must reproduce from its forward: RNG state and autocast state.

Dropout draws from the global RNG; a backward re-run must draw the same numbers without
disturbing the RNG stream the rest of training sees (as `torch.utils.checkpoint` does).
Backward runs outside the forward's autocast region, so the re-run re-enters it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True)
class ReplayState:
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device: torch.device
    autocast_enabled: bool
    autocast_dtype: torch.dtype


def capture(device: torch.device) -> ReplayState:
    """The RNG and autocast state in force right now, before a layer's forward."""
    cuda = device.type == "cuda"
    return ReplayState(
        cpu_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if cuda else None,
        device=device,
        autocast_enabled=torch.is_autocast_enabled(device.type),
        autocast_dtype=torch.get_autocast_dtype(device.type),
    )


@contextmanager
def replaying(state: ReplayState) -> Iterator[None]:
    """Run the body with the captured RNG and autocast state; restore the RNG after."""
    cuda = state.device.type == "cuda"
    devices = [state.device] if cuda else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(state.cpu_rng)
        if cuda:
            torch.cuda.set_rng_state(state.cuda_rng, state.device)
        with torch.autocast(state.device.type, dtype=state.autocast_dtype,
                            enabled=state.autocast_enabled):
            yield
