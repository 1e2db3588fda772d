"""Fixed homes priced without a MIP solver (baselines, the warm start, machines where
PySCIPOpt cannot load).

With every home fixed, the MIP's only freedom is the per-window exposure; the schedule
decoder spills what a window cannot carry into the last window allowed, and
`window_objective_s` prices the result, so capacities and seconds need no solver.
"""

from __future__ import annotations

from lazytrain_accel.planning.plan import Home, Solution
from lazytrain_accel.planning.problem import Problem
from lazytrain_accel.planning.schedule import blocks_of, schedule_transfers, window_objective_s


def admissible(p: Problem, homes: list[Home] | tuple[Home, ...]) -> bool:
    """Whether fixed `homes` respect the MIP's structure: blocks start on the GPU, no
    block re-runs a layer whose compute copy lives on NVMe (`Problem.edges`), and every
    offloaded boundary has windows to leave and come back in."""
    if any(e - s >= 2 and homes[s] != Home.GPU for s, e in blocks_of(homes)):
        return False
    if any(homes[j] == Home.RECOMPUTE for j in p.state.copies if j < len(homes)):
        return False
    return all(p.can_offload(i, nvme=h == Home.NVME) for i, h in enumerate(homes)
               if h in (Home.CPU, Home.NVME))


def evaluate_fixed(p: Problem, homes: list[Home] | tuple[Home, ...]) -> Solution:
    """Capacities (as the MIP's rows count them) and the window objective of `homes`."""
    count = {h: sum(1 for x in homes if x == h) for h in Home}
    longest = max(e - s for s, e in blocks_of(homes))
    # The MIP's block cache is one boundary per position beyond the first of the longest
    # block (`cache_len_ge_l` for l = 2..longest).
    need = p.tier_need_bytes(gpu=count[Home.GPU], cache=longest - 1, cpu=count[Home.CPU],
                             nvme=count[Home.NVME])
    exposed = (0.0,) * p.num_windows
    objective_s = window_objective_s(p, homes, schedule_transfers(p, homes, exposed))
    return Solution(
        status="baseline", homes=tuple(homes), exposed_s=exposed, objective_s=objective_s,
        shortfall_bytes={k: need[k] - p.budget_bytes(k) for k in need
                         if need[k] > p.budget_bytes(k)})
