"""What a plan asks of the drives per step (`lazytrain plan` prints it): the NVMe bytes
read and written (boundaries and host state), the share of the drives' bandwidth the step
keeps busy, the seconds the drives add to the step, and the step's physical floor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lazytrain_accel.planning.node import state_shards
from lazytrain_accel.planning.plan import Home, Plan
from lazytrain_accel.planning.problem import layer_state_sizes
from lazytrain_accel.planning.simulate import simulate
from lazytrain_accel.planning.state import step_nvme_state_bytes
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
    busy_s: float  # the slower direction at the drives' rates (reads and writes overlap)
    drive_added_s: float  # the step less the same plan's step on unbounded drives
    compute_s: float  # compute, recompute and the engine's overheads
    step_s: float

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
    busy_s = max(read / hardware.nvme_read_bytes_per_s,
                 written / hardware.nvme_write_bytes_per_s)
    unbound = dataclasses.replace(
        hardware, nvme_read_bytes_per_s=hardware.nvme_read_bytes_per_s * _UNBOUND_DRIVES,
        nvme_write_bytes_per_s=hardware.nvme_write_bytes_per_s * _UNBOUND_DRIVES)
    rebased = dataclasses.replace(plan, fingerprint=run_fingerprint(model, unbound))
    pred = plan.prediction
    return NvmeTraffic(
        read_bytes=read, written_bytes=written, busy_s=busy_s,
        drive_added_s=max(pred.step_s - simulate(rebased, model, unbound).step_s, 0.0),
        compute_s=pred.compute_s + pred.recompute_s + pred.overhead_s + pred.host_s,
        step_s=pred.step_s)
