"""The planning problem: one training step of a layer chain as windows, links and tiers.

Everything the MIP, the baselines, the schedule decoder and the simulator share lives
here, so the four agree on the cost model by construction (see docs/planner.md):

* Windows (plan.py indexing): F_1..F_L then B_L..B_1. F_j lasts one layer forward;
  B_j lasts the layer's forward re-run plus its backward, plus the block's recompute
  when j ends a recompute block; B_L also holds the head (final norm, lm_head, loss).
* Mandatory traffic per window: the next window's layer weights (H2D), the previous
  backward layer's weight gradients (D2H), and the weight re-stream of recompute.
* Activation traffic: boundary i homed off the GPU is offloaded (D2H) in F_{i+1}..F_L and
  reloaded (H2D) in B_L..B_{i+2}; an NVMe boundary is written to NVMe one window after
  its D2H may start (F_{i+2}..F_L) and read one window before its H2D must end
  (B_L..B_{i+3}), and crosses PCIe as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile

GIB = 2**30

#: Host bytes per parameter: fp32 master (4) + fp32 gradient accumulator (4) + two 8-bit
#: Adam moments (2); the per-block fp32 absmax adds < 2% and is covered by the reserve.
HOST_BYTES_PER_PARAM = 10

#: Device memory set aside for the CUDA context, cuBLAS workspaces and allocator
#: fragmentation: the plan never fills the GPU budget to the last byte.
GPU_RESERVE_FRACTION = 0.04

#: Boundaries in flight between tiers at once (one being offloaded, one reloaded): they
#: sit on the device beside the GPU-homed ones while their copy runs.
STAGING_BOUNDARIES = 2


class PlanInfeasibleError(ValueError):
    """No plan of the strategy fits the budgets; `shortfall_bytes` names each binding
    resource ("gpu", "cpu", "nvme") with the bytes it lacks."""

    def __init__(self, message: str, shortfall_bytes: dict[str, int]) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


@dataclass(kw_only=True, frozen=True)
class Budgets:
    """Bytes each tier may hold for one run (device, host DRAM, NVMe)."""

    gpu_bytes: int
    cpu_bytes: int
    nvme_bytes: int

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "nvme_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Budgets.{name}={getattr(self, name)} is negative; give "
                                 "a byte count >= 0")

    @classmethod
    def from_hardware(cls, hw: HardwareProfile, gpu_memory_limit_gb: float = 0,
                      cpu_memory_limit_gb: float = 0, nvme_limit_gb: float = 0) -> Budgets:
        """Budgets from a profile; a limit of 0 means the profile's capacity (GB = 2**30)."""
        def pick(limit_gb: float, capacity_bytes: int, what: str) -> int:
            if limit_gb < 0:
                raise ValueError(f"{what}={limit_gb} is negative; give GB >= 0 (0 = the "
                                 "hardware profile's capacity)")
            return int(limit_gb * GIB) if limit_gb > 0 else int(capacity_bytes)

        return cls(gpu_bytes=pick(gpu_memory_limit_gb, hw.gpu_memory_bytes, "gpu_memory_gb"),
                   cpu_bytes=pick(cpu_memory_limit_gb, hw.cpu_memory_bytes, "cpu_memory_gb"),
                   nvme_bytes=pick(nvme_limit_gb, hw.nvme_bytes, "nvme_gb"))


@dataclass(kw_only=True, frozen=True)
class Problem:
    """Numbers of one planning instance, in bytes and seconds."""

    num_layers: int
    max_block: int  # K: longest recompute block (edge length)
    boundary_bytes: int  # A
    layer_param_bytes: int  # P, one layer's weights as streamed H2D
    layer_grad_bytes: int  # G, one layer's weight gradients streamed D2H
    fwd_s: float  # one layer forward
    bwd_s: float  # one layer backward proper (its forward re-run is added separately)
    head_s: float  # final norm + head + loss, forward and backward
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    static_gpu_bytes: int  # everything on the device that is not a boundary activation
    static_cpu_bytes: int
    tail_d2h_bytes: int  # gradients that leave after the last backward window
    budgets: Budgets
    # Offloaded boundaries on the device while their copy runs; `make_plan` raises it when
    # the simulated step shows more in flight (saturated links).
    staging_boundaries: int = STAGING_BOUNDARIES
    param_count: int
    tokens_per_step: int

    # ---- windows -------------------------------------------------------------------
    @property
    def num_windows(self) -> int:
        return 2 * self.num_layers

    def base_duration_s(self, window: int) -> float:
        """Compute seconds of a window without recompute."""
        L = self.num_layers
        if window < L:
            return self.fwd_s
        return self.fwd_s + self.bwd_s + (self.head_s if window == L else 0.0)

    def recompute_s(self, s: int, e: int) -> float:
        """R[s,e]: re-running layers s+1..e-1 forward, at the start of window B_e."""
        return (e - s - 1) * self.fwd_s

    def restream_stall_s(self, s: int, e: int) -> float:
        """Recompute waits for weights: layer k+1's re-stream starts with layer k's re-run,
        so each of the last n-2 re-runs waits max(0, P/h2d - f)."""
        stall = self.layer_param_bytes / self.h2d_bytes_per_s - self.fwd_s
        return max(e - s - 2, 0) * max(stall, 0.0)

    def weight_h2d_bytes(self, window: int) -> int:
        """Weights prefetched for the next window's layer (none when it is the same layer)."""
        L = self.num_layers
        return 0 if window in (L - 1, 2 * L - 1) else self.layer_param_bytes

    def grad_d2h_bytes(self, window: int) -> int:
        """Gradients of the previous backward layer leave while this window computes."""
        return self.layer_grad_bytes if window > self.num_layers else 0

    def restream_windows(self, s: int, e: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((window, bytes), (window, bytes)) of the weight re-stream block (s,e) costs:
        the first recomputed layer is prefetched in the window before B_e, the others
        stream during B_e's recompute."""
        n = e - s
        L = self.num_layers
        first = (2 * L - e - 1, self.layer_param_bytes if n >= 2 else 0)
        rest = (2 * L - e, max(n - 2, 0) * self.layer_param_bytes)
        return first, rest

    def edges(self) -> list[tuple[int, int]]:
        L, K = self.num_layers, self.max_block
        return [(s, e) for s in range(L) for e in range(s + 1, min(s + K, L) + 1)]

    # ---- per-boundary transfer windows (inclusive ranges; empty when lo > hi) --------
    def d2h_windows(self, i: int) -> tuple[int, int]:
        return i, self.num_layers - 1

    def nvme_write_windows(self, i: int) -> tuple[int, int]:
        return i + 1, self.num_layers - 1

    def h2d_windows(self, i: int) -> tuple[int, int]:
        return self.num_layers, 2 * self.num_layers - i - 2

    def nvme_read_windows(self, i: int) -> tuple[int, int]:
        return self.num_layers, 2 * self.num_layers - i - 3

    def can_offload(self, i: int, nvme: bool = False) -> bool:
        """Whether boundary i has a window to leave and a window to come back in."""
        if i in (0, self.num_layers):
            return False
        ranges = [self.d2h_windows(i), self.h2d_windows(i)]
        if nvme:
            ranges += [self.nvme_write_windows(i), self.nvme_read_windows(i)]
        return all(lo <= hi for lo, hi in ranges)

    # ---- constants of the step -------------------------------------------------------
    @property
    def prologue_s(self) -> float:
        """Layer 1's weights arrive before anything can run."""
        return self.layer_param_bytes / self.h2d_bytes_per_s

    @property
    def tail_s(self) -> float:
        return self.tail_d2h_bytes / self.d2h_bytes_per_s

    @property
    def compute_s(self) -> float:
        return sum(self.base_duration_s(w) for w in range(self.num_windows))

    @property
    def gpu_reserve_bytes(self) -> int:
        return int(GPU_RESERVE_FRACTION * self.budgets.gpu_bytes)

    @property
    def gpu_fixed_bytes(self) -> int:
        """Device bytes the MIP charges besides GPU homes and the block cache."""
        staging = self.staging_boundaries * self.boundary_bytes
        return self.static_gpu_bytes + staging + self.gpu_reserve_bytes


def build_problem(model: ModelProfile, hardware: HardwareProfile, *,
                  budgets: Budgets | None = None, max_recompute_block: int = 8) -> Problem:
    """The instance for `model` at its batch shape on `hardware` under `budgets`."""
    if max_recompute_block < 1:
        raise ValueError(f"max_recompute_block={max_recompute_block} must be >= 1 (1 = never "
                         "recompute)")
    if model.num_layers < 1:
        raise ValueError(f"model has num_layers={model.num_layers}; need at least one layer")
    for name in ("achieved_flops_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
                 "nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
        if getattr(hardware, name) <= 0:
            raise ValueError(f"hardware profile {hardware.name!r} has {name}="
                             f"{getattr(hardware, name)}; rates must be > 0")
    budgets = budgets or Budgets.from_hardware(hardware)
    flops_per_s = hardware.achieved_flops_per_s
    K = max_recompute_block
    # Three weight buffers when recompute is possible: the running layer, the next one,
    # and the first recomputed layer prefetched beside the block's last layer.
    weight_buffers = 3 if K >= 2 else 2
    # The head + loss runs between the last forward and the first backward, so its
    # working set and one layer's backward working set are never live together.
    working = max(model.layer_working_bytes, model.head_working_bytes)
    static_gpu = (weight_buffers * model.layer_param_bytes + 2 * model.layer_grad_bytes
                  + working + 2 * model.resident_param_bytes)
    params = model.geometry.total_param_count
    return Problem(
        num_layers=model.num_layers, max_block=K, boundary_bytes=model.boundary_bytes,
        layer_param_bytes=model.layer_param_bytes, layer_grad_bytes=model.layer_grad_bytes,
        fwd_s=model.layer_fwd_flops / flops_per_s, bwd_s=model.layer_bwd_flops / flops_per_s,
        head_s=3.0 * model.head_fwd_flops / flops_per_s,  # backward ~ 2x forward
        h2d_bytes_per_s=hardware.h2d_bytes_per_s, d2h_bytes_per_s=hardware.d2h_bytes_per_s,
        nvme_read_bytes_per_s=hardware.nvme_read_bytes_per_s,
        nvme_write_bytes_per_s=hardware.nvme_write_bytes_per_s,
        static_gpu_bytes=static_gpu,
        # Pinned staging: two layers of weights, and two bounce buffers for NVMe boundaries.
        static_cpu_bytes=(params * HOST_BYTES_PER_PARAM + 2 * model.layer_param_bytes
                          + STAGING_BOUNDARIES * model.boundary_bytes),
        tail_d2h_bytes=model.layer_grad_bytes + model.resident_param_bytes,
        budgets=budgets, param_count=params, tokens_per_step=model.tokens_per_step,
    )
