"""`Solution`: what a strategy decided for one `Problem`, from the MIP or a fixed baseline.

One frozen type for every strategy; a status change is `dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lazytrain_accel.planning.plan import Home


@dataclass(kw_only=True, frozen=True)
class Solution:
    status: str  # "optimal", "gaplimit", "timelimit", "baseline", "fallback", "infeasible"
    homes: tuple[Home, ...] | None  # None when no feasible point was found
    exposed_s: tuple[float, ...] = ()  # per window, what the links add to its compute
    objective_s: float | None = None  # recompute + stalls + exposure (+ tie-breakers)
    gap: float = 0.0  # (incumbent - bound) / predicted step
    solve_s: float = 0.0
    shortfall_bytes: Mapping[str, int] = field(default_factory=dict)  # per binding tier
    message: str = ""

    @property
    def feasible(self) -> bool:
        return self.homes is not None and not self.shortfall_bytes
