"""The planner: problem, MIP, baselines, simulator. Never imports torch."""

from lazytrain_accel.planning.admission import max_batch_size
from lazytrain_accel.planning.plan import Home, Plan, PlanError, Transfer, TransferKind
from lazytrain_accel.planning.problem import Budgets, PlanInfeasibleError, Problem, build_problem
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.simulate import SimulationResult, simulate
from lazytrain_accel.planning.solve import STRATEGIES, make_plan

__all__ = ["STRATEGIES", "Budgets", "Home", "Plan", "PlanError", "PlanInfeasibleError",
           "PlanRequest", "Problem", "SimulationResult", "Transfer", "TransferKind",
           "build_problem", "make_plan", "max_batch_size", "simulate"]
