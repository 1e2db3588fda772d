"""The planner: problem, MIP, baselines, simulator. Never imports torch.

Names load on first use (PEP 562), so `import lazytrain_accel.planning.plan` (what the
engine reads) loads the standard-library `Plan` IR alone, not profiling or the solver.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "max_batch_size": "admission", "Home": "plan", "Plan": "plan", "PlanError": "plan",
    "Transfer": "plan", "TransferKind": "plan", "Budgets": "problem",
    "PlanInfeasibleError": "problem", "Problem": "problem", "build_problem": "problem",
    "SimulationResult": "simulate", "simulate": "simulate", "STRATEGIES": "solve",
    "make_plan": "solve",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
