"""What a plan asks of the drives per step (`lazytrain plan` prints it): the NVMe bytes
read and written (boundaries and host state), the share of the drives' bandwidth the step
keeps busy, the seconds the drives add to the step, the step's physical floor, and the
floor of its order: the update's reads wait for the gradients' norm (clipping), so they
cannot share the backward's time on the drive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lazytrain_accel.planning.node import state_shards
from lazytrain_accel.planning.plan import Home, Plan
from lazytrain_accel.planning.problem import build_problem, layer_state_sizes
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.planning.state import step_nvme_state_bytes, update_phase_bytes
from lazytrain_accel.profiling.fingerprint import run_fingerprint
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile

#: How much faster than the profile's the drives are made to price a step without them.
_UNBOUND_DRIVES = 1e6


@dataclass(kw_only=True, frozen=True)
class NvmeTraffic:
    """One step's NVMe traffic of a plan."""

    read_bytes: int
    written_bytes: int
    busy_s: float  # the drives' time: the slower direction, or both on a shared drive
    drive_added_s: float  # the step less the same plan's step on unbounded drives
    compute_s: float  # compute, recompute and the engine's overheads
    step_s: float
    backward_s: float  # the backward's compute
    update_read_bytes: int  # read by the update phase (masters, moments, gradients)
    read_bytes_per_s: float

    @property
    def ordered_floor_s(self) -> float:
        """The floor of the step's order: the update reads its state only once the
        backward has ended (the clip needs every gradient's norm), and the next backward
        ends only after the update of every layer, so a step takes at least the backward
        plus the update phase's reads, whatever the schedule."""
        return self.backward_s + self.update_read_bytes / self.read_bytes_per_s

    @property
    def floor_s(self) -> float:
        """The physical floor: the larger of the compute and the drives' busy time."""
        return max(self.compute_s, self.busy_s)

    @property
    def bandwidth_share(self) -> float:
        """The share of the step the drives' busier direction runs."""
        return self.busy_s / self.step_s if self.step_s else 0.0


def nvme_traffic(plan: Plan, model: ModelProfile, hardware: HardwareProfile) -> NvmeTraffic:
    """The NVMe traffic of `plan` for `model` on `hardware` (the plan's profiles), of one
    node's share of the state."""
    boundary_bytes = plan.count_homes()[Home.NVME.value] * plan.boundary_bytes
    sizes = layer_state_sizes(model, plan.optimizer,
                              shards=state_shards(plan.node_layout, plan.nodes))
    state_read, state_written = step_nvme_state_bytes(plan.state, sizes, plan.num_layers)
    read, written = boundary_bytes + state_read, boundary_bytes + state_written
    read_s = read / hardware.nvme_read_bytes_per_s
    written_s = written / hardware.nvme_write_bytes_per_s
    busy_s = max(read_s, written_s) if hardware.nvme_full_duplex else read_s + written_s
    update_read, _ = update_phase_bytes(plan.state, sizes, plan.num_layers)
    problem = build_problem(model, hardware, resident_update=plan.resident_update,
                            optimizer=plan.optimizer, gpus_per_node=plan.gpus_per_node,
                            nodes=plan.nodes, node_layout=plan.node_layout, state=plan.state)
    unbound = dataclasses.replace(
        hardware, nvme_read_bytes_per_s=hardware.nvme_read_bytes_per_s * _UNBOUND_DRIVES,
        nvme_write_bytes_per_s=hardware.nvme_write_bytes_per_s * _UNBOUND_DRIVES)
    rebased = dataclasses.replace(plan, fingerprint=run_fingerprint(model, unbound))
    pred = plan.prediction
    return NvmeTraffic(
        read_bytes=read, written_bytes=written, busy_s=busy_s,
        drive_added_s=max(pred.step_s - simulate(rebased, model, unbound).step_s, 0.0),
        compute_s=pred.compute_s + pred.recompute_s + pred.overhead_s + pred.host_s,
        step_s=pred.step_s, backward_s=plan.num_layers * problem.bwd_run_s,
        update_read_bytes=update_read, read_bytes_per_s=hardware.nvme_read_bytes_per_s)
