"""The planner: problem, MIP, baselines, simulator. Never imports torch."""

from lazytrain_accel.planning.plan import Home, Plan, PlanError, Transfer, TransferKind

__all__ = ["Home", "Plan", "PlanError", "Transfer", "TransferKind"]
