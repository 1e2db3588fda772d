"""Baselines evaluated without a MIP solver, for machines where PySCIPOpt cannot load.

With every home fixed, the MIP's only freedom is the per-window exposure; the schedule
decoder already spills what a window cannot carry into the last window allowed, and
`predict` prices the result, so capacities and seconds need no solver at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazytrain_accel.planning.plan import Home
from lazytrain_accel.planning.problem import Problem
from lazytrain_accel.planning.schedule import blocks_of, predict, schedule_transfers


@dataclass(kw_only=True)
class FixedSolution:
    """The fields of `milp.MilpSolution` that `plan_from_solution` and errors read."""

    status: str
    homes: list[Home]
    exposed_s: list[float]
    objective_s: float
    gap: float = 0.0
    solve_s: float = 0.0
    shortfall_bytes: dict[str, int] = field(default_factory=dict)
    message: str = ""


def evaluate_fixed(p: Problem, homes: list[Home]) -> FixedSolution:
    """Capacities (as the MIP's rows count them) and predicted seconds of fixed `homes`."""
    A = p.boundary_bytes
    count = {h: sum(1 for x in homes if x == h) for h in Home}
    longest = max(e - s for s, e in blocks_of(homes))
    # The MIP's block cache is one boundary per position beyond the first of the longest
    # block (`cache_len_ge_l` for l = 2..longest).
    need = {"gpu": p.gpu_fixed_bytes + A * (count[Home.GPU] + longest - 1),
            "cpu": p.static_cpu_bytes + A * count[Home.CPU],
            "nvme": A * count[Home.NVME]}
    budget = {"gpu": p.budgets.gpu_bytes, "cpu": p.budgets.cpu_bytes,
              "nvme": p.budgets.nvme_bytes}
    exposed = [0.0] * p.num_windows
    prediction = predict(p, homes, schedule_transfers(p, homes, exposed))
    return FixedSolution(
        status="baseline", homes=list(homes), exposed_s=exposed,
        objective_s=prediction.recompute_s + prediction.exposed_s,
        shortfall_bytes={k: need[k] - budget[k] for k in need if need[k] > budget[k]})
