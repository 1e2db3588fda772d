"""`PlanRequest`: what a caller asks of `make_plan`, beside the model and the hardware.

One value that `make_plan`, `max_batch_size` and `with_largest_batch` take alike, so the
admission search and the refusal's "largest batch" ask exactly what the run asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain_accel.config import RESIDENT_UPDATE_CHOICES
from lazytrain_accel.planning.node import check_node_shape, resolve_node_layout
from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.problem import Budgets
from lazytrain_accel.planning.state_search import CANDIDATE_NAMES

#: The `PlanRequest.host_state` values that let the planner choose among some parts only:
#: "copies" the compute copies (what ranks each with its own host copy may home:
#: docs/engine.md "Host state on NVMe"), "streamed" the compute copies and the gradients
#: (the masters and moments stay in DRAM).
RESTRICTED_PARTS: dict[str, tuple[str, ...]] = {"copies": ("copies",),
                                                "streamed": ("copies", "grads")}
#: The parts the local ranks sharing a node store may home on NVMe (`gpus_per_node` > 1),
#: whatever `host_state` allows beside (`solve.plan_host_state`): each layer's masters and
#: moments, on the drive of the rank that updates it; its compute copy stays in the store
#: for every rank, and the gradients in DRAM for the reduce.
NODE_STATE_PARTS: tuple[str, ...] = ("optimizer",)
#: `PlanRequest.host_state`: the planner's choice (of every part, or of some), all in
#: DRAM, or one candidate.
HOST_STATES: tuple[str, ...] = ("auto", *RESTRICTED_PARTS, "dram", *CANDIDATE_NAMES)

#: Seconds the elastic re-solve that names a refusal's shortfall may take: it starts from
#: the baseline closest to fitting, so on a limit it still names what that plan lacks.
#: Why 3 s: docs/benchmarks.md "Planner".
DIAGNOSE_TIME_LIMIT_S = 3.0


@dataclass(kw_only=True, frozen=True)
class PlanRequest:
    """A plan's strategy, budgets and solver limits (see `make_plan`)."""

    strategy: str = "lazytrain"
    budgets: Budgets | None = None  # None: the hardware's capacities
    max_recompute_block: int = 8  # layers a recompute block may span
    time_limit_s: float = 60.0  # the MIP's time limit
    gap: float = 0.001  # the MIP's relative optimality gap
    # The hybrid 8-bit host optimizer's overlapped update in the prediction (and the
    # residents' update allowed on the GPU).
    include_optimizer: bool = True
    # The refusal's elastic re-solve limit (0: the closest baseline's shortfall, no solve).
    diagnose_s: float = DIAGNOSE_TIME_LIMIT_S
    resident_update: str = "auto"  # RESIDENT_UPDATE_CHOICES
    # Local ranks (GPUs) sharing one node's host, and nodes (`node.py`); `budgets.cpu_bytes`
    # is then the node's host budget.
    gpus_per_node: int = 1
    nodes: int = 1
    # How the host state spreads over the nodes: "auto" (split over several), or one of
    # `node.NODE_LAYOUTS` ("replicated": every node holds all of it).
    node_layout: str = "auto"
    # The plan a re-plan runs now: the MIP's warm start where it fits, and returned
    # (re-priced) when the simulator prices it faster than every new plan.
    running: Plan | None = None
    # Where the layers' host state may live when DRAM cannot hold it all (`HOST_STATES`):
    # "auto" (the fastest of `state_search.state_candidates` and the MIP's choice),
    # "copies" or "streamed" (the same, only those parts on NVMe: `RESTRICTED_PARTS`),
    # "dram" (never on NVMe: refused where it does not fit), or one candidate by name
    # (the baselines).
    host_state: str = "auto"

    def __post_init__(self) -> None:
        check_node_shape(gpus_per_node=self.gpus_per_node, nodes=self.nodes)
        resolve_node_layout(self.node_layout, self.nodes)  # raises on an unknown one
        if self.host_state not in HOST_STATES:
            raise ValueError(f"host_state={self.host_state!r} is not one of {HOST_STATES}")
        if self.resident_update not in RESIDENT_UPDATE_CHOICES:
            raise ValueError(f"resident_update={self.resident_update!r} is not one of "
                             f"{RESIDENT_UPDATE_CHOICES}")
