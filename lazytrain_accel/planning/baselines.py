"""Baseline strategies as fixed homes in the MIP's own space, so every comparison with
the MIP is like for like (same windows, same traffic, same capacities)."""

from __future__ import annotations

from collections.abc import Callable

from lazytrain_accel.planning.plan import Home
from lazytrain_accel.planning.problem import Problem

#: MegaTrain keeps a checkpoint every 4 layers on the GPU and recomputes in between.
MEGATRAIN_INTERVAL = 4


def megatrain_homes(p: Problem) -> list[Home]:
    L = p.num_layers
    return [Home.GPU if i % MEGATRAIN_INTERVAL == 0 or i == L else Home.RECOMPUTE
            for i in range(L + 1)]


def checkpoint_all_homes(p: Problem) -> list[Home]:
    return [Home.GPU] * (p.num_layers + 1)


def offload_all_homes(p: Problem) -> list[Home]:
    """Every boundary to CPU, except those with no window to come back in (the last one
    or two, needed by the first backward windows) and 0 and L, which stay on the GPU."""
    return [Home.CPU if p.can_offload(i) else Home.GPU for i in range(p.num_layers + 1)]


BASELINES: dict[str, Callable[[Problem], list[Home]]] = {
    "megatrain": megatrain_homes,
    "checkpoint_all": checkpoint_all_homes,
    "offload_all": offload_all_homes,
}

#: The baselines that keep every boundary on the GPU (the GPU-only MIP's warm start).
GPU_ONLY_BASELINES: tuple[str, ...] = ("megatrain", "checkpoint_all")
