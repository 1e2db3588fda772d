"""Hardware profiles: capacities and rates of one GPU + host + NVMe machine."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(kw_only=True, frozen=True)
class HardwareProfile:
    name: str
    gpu_name: str
    gpu_memory_bytes: int
    cpu_memory_bytes: int
    nvme_bytes: int
    peak_bf16_flops_per_s: float  # dense, from the vendor sheet
    achieved_flops_per_s: float  # realistic matmul rate used to turn FLOPs into seconds
    h2d_bytes_per_s: float  # pinned host -> device
    d2h_bytes_per_s: float  # device -> pinned host
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    cpu_optimizer_params_per_s: float  # hybrid 8-bit update rate of the host
    source: str  # where the numbers come from

    def to_dict(self) -> dict:
        return asdict(self)


#: Filled in by the profiling work (issue 2); keys are preset names.
HARDWARE_PRESETS: dict[str, HardwareProfile] = {}
