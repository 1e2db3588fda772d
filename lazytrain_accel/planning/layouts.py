"""A plan's node layouts side by side (`lazytrain plan --nodes K`): per layout
(`node.NODE_LAYOUTS`), a node's host bytes at the plan's peak and the bytes it sends to
the other nodes each step, with their seconds on the node's network.

Both come from the same model as the plan: the host bytes are the plan's simulated peak
with its own static terms swapped for the layout's (`host.host_base_terms`, `shards`),
the network bytes `node.network_bytes_per_step`. The collectives overlap the step (the
gradients' reduce the backward, the compute copy's gather the next forward, as the
update does), so the job runs at the slower of the step and the network.
Docs: docs/planner.md "Several nodes".
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain_accel.planning.node import NODE_LAYOUTS, network_bytes_per_step
from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.problem import Budgets, build_problem
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile


@dataclass(frozen=True, kw_only=True)
class LayoutFigures:
    """One layout's figures for a plan's node."""

    layout: str
    host_bytes: int  # a node's host bytes at the plan's peak
    network_bytes: int  # what a node sends to the others per step
    network_s: float  # those bytes at the node's network rate
    fits: bool  # the host bytes within the budget

    def job_tokens_per_s(self, plan: Plan) -> float:
        """The job's tokens/s: K nodes of N ranks, each step at least the network's."""
        pred = plan.prediction
        step_s = max(pred.step_s, self.network_s)
        return plan.nodes * plan.gpus_per_node * pred.tokens_per_s * pred.step_s / step_s


def layout_figures(plan: Plan, model: ModelProfile, hardware: HardwareProfile,
                   budgets: Budgets) -> dict[str, LayoutFigures]:
    """Each layout's figures for `plan` (made for `model` on `hardware` in `budgets`)."""
    longest = max(e - s for s, e in plan.blocks)
    problems = {layout: build_problem(
        model, hardware, budgets=budgets, max_recompute_block=longest,
        resident_update=plan.resident_update, optimizer=plan.optimizer,
        gpus_per_node=plan.gpus_per_node, nodes=plan.nodes, node_layout=layout,
        state=plan.state) for layout in NODE_LAYOUTS}
    own = problems[plan.node_layout].static_cpu_bytes
    # the whole node's host-updated parameters (the replicated problem's: not cut)
    host_params = problems["replicated"].host_update_param_count
    on_device = plan.resident_update == "device"
    out = {}
    for layout, p in problems.items():
        host = plan.prediction.peak_cpu_bytes - own + p.static_cpu_bytes
        sent = network_bytes_per_step(
            host_update_params=host_params,
            every_rank_params=p.resident_update_param_count if on_device else 0,
            copy_bytes_per_param=model.compute_bytes_per_elem, nodes=plan.nodes, layout=layout)
        out[layout] = LayoutFigures(layout=layout, host_bytes=host, network_bytes=sent,
                                    network_s=sent / hardware.internode_bytes_per_s,
                                    fits=host <= budgets.cpu_bytes)
    return out
