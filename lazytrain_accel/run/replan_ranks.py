"""`replan="auto"` on a launch of several ranks: one re-planner decides for all.

At every step boundary each rank contributes its engine's run totals (one all-gather).
Rank 0's `Replanner` calibrates on their combination and alone solves, switches and
reverts; then it broadcasts the plan it runs when that changed, and every other rank
adopts it at the same boundary. So the ranks never stream two plans.

How the ranks' measurements combine (`combined_totals`):
* a copy kind (H2D, D2H, NVMe read or write) takes the rank whose copies of that kind
  took longest, its seconds and its bytes: a link priced at its slowest rank (a node's
  drive, or its host memory, is shared, and the step waits for the slowest rank);
* compute, recompute, the layer-wise update and the host's work per transfer take the
  median across the ranks; the layer counters are rank 0's (every rank runs the plan).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

from lazytrain_accel.distributed import ranks
from lazytrain_accel.engine.stats import StepStats
from lazytrain_accel.planning.plan import Prediction
from lazytrain_accel.run.replanner import CurrentRun, ReplannedEngine, Replanner
from lazytrain_accel.run.setup import PreparedRun

logger = logging.getLogger("lazytrain_accel")

_MEDIAN_FIELDS = ("compute_s", "recompute_s", "optimizer_update_s", "stall_s",
                  "optimizer_wait_s", "device_update_s")


def combined_totals(every: list[StepStats]) -> StepStats:
    """The launch's run totals from each rank's (the module docstring's rule)."""
    out = dataclasses.replace(every[0], transfer_s=dict(every[0].transfer_s),
                              transfer_bytes=dict(every[0].transfer_bytes),
                              host_work_s=dict(every[0].host_work_s),
                              host_work_bytes=dict(every[0].host_work_bytes))
    for name in _MEDIAN_FIELDS:
        setattr(out, name, statistics.median(getattr(s, name) for s in every))
    for kind in out.transfer_s:
        slowest = max(every, key=lambda s: s.transfer_s.get(kind, 0.0))
        out.transfer_s[kind] = slowest.transfer_s.get(kind, 0.0)
        out.transfer_bytes[kind] = slowest.transfer_bytes.get(kind, 0)
    for kind in out.host_work_s:
        out.host_work_s[kind] = statistics.median(s.host_work_s.get(kind, 0.0) for s in every)
        out.host_work_bytes[kind] = int(statistics.median(
            s.host_work_bytes.get(kind, 0) for s in every))
    return out


class LaunchTotals:
    """The launch's run totals (`combined_totals`); every rank calls `total_stats` at the
    same step boundary (an all-gather)."""

    def __init__(self, engine: ReplannedEngine) -> None:
        self._engine = engine

    def total_stats(self) -> StepStats:
        return combined_totals(ranks.gathered(self._engine.total_stats()))


class LaunchReplanner:
    """Every rank's re-planner: `replanner` (rank 0's, fed `LaunchTotals`; None on the
    other ranks) decides, `state` (each rank's `RunState`) adopts at the boundary."""

    def __init__(self, *, state: CurrentRun, totals: LaunchTotals,
                 replanner: Replanner | None) -> None:
        self._state, self._totals, self.replanner = state, totals, replanner
        self._decisions = 0  # rank 0's switches and reverts announced so far
        self.steps = 0
        self.adopted: list[int] = []  # the boundaries at which this rank took a new plan

    def on_step(self) -> None:
        """One optimizer step ended, on every rank: measure together, decide on rank 0,
        adopt its plan everywhere at this boundary."""
        self.steps += 1
        if self.replanner is not None:
            self.replanner.on_step()  # calls `totals.total_stats()`: the all-gather
        else:
            self._totals.total_stats()
        changed = ranks.from_first(self._changed)
        if changed is None:
            return
        self.adopted.append(self.steps)
        if self.replanner is None:  # rank 0 adopted it deciding
            self._state.adopt(changed)
            logger.info("lazytrain: rank %d takes rank 0's plan %s at step %d",
                        ranks.global_rank(), ranks.plan_digest(changed.plan), self.steps)

    def _changed(self) -> PreparedRun | None:
        """Rank 0: the run it switched or reverted to at this boundary, else None."""
        decisions = len(self.replanner.switches) + len(self.replanner.reverts)
        if decisions == self._decisions:
            return None
        self._decisions = decisions
        return self._state.run

    @property
    def prediction(self) -> Prediction:
        """The running plan's prediction: rank 0's calibrated one, the plan's elsewhere."""
        if self.replanner is not None:
            return self.replanner.prediction
        return self._state.run.plan.prediction

    def close(self) -> None:
        if self.replanner is not None:
            self.replanner.close()
