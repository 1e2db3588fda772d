"""The planning problem: one training step of a layer chain as windows, links and tiers.

This is the one cost model: every duration, byte count and window index the MIP
(`milp.py`), the schedule decoder (`schedule.py`), the baselines (`no_solver.py`) and the
simulator (`simulate.py`) use is a method here. The methods that depend on the plan's
choices take the edge weights (`{(s, e): x}`) or tier counts, so the same code returns
floats for a fixed plan and linear expressions for the MIP's variables. Windows follow
plan.py's indexing, F_1..F_L then B_L..B_1; what each window lasts and moves (weights,
gradients, boundaries, recompute, overheads): docs/planner.md "The step as windows".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lazytrain_accel.device_update import DEVICE_UPDATE_CHUNK_ELEMENTS
from lazytrain_accel.planning.host import (
    GRAD_BYTES_PER_PARAM,
    MASTER_BYTES_PER_PARAM,
    OPTIMIZER_STATE_BYTES_PER_PARAM,
    activation_host_terms,
    check_optimizer,
    host_base_terms,
    master_shards,
    writes_compute_copies,
)
from lazytrain_accel.planning.node import (
    NODE_LAYOUTS,
    check_node_shape,
    host_update_bytes_per_s,
    link_bytes_per_s,
    share_update_params_per_s,
    state_shards,
)
from lazytrain_accel.planning.plan import (
    RESIDENT_UPDATES,
    STATE_PARTS,
    Home,
    StateHomes,
    backward_window,
    forward_window,
)
from lazytrain_accel.planning.state import (
    StateSizes,
    StateWeights,
    backward_state_bytes,
    homed_parts,
    host_terms_with_state,
    nvme_state_bytes,
    state_sizes,
    weights_of,
)
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile
from lazytrain_accel.profiling.working_set import (
    device_working_terms,
    key_pass_flops,
    tile_overhead_s,
)

GIB = 2**30

#: The links activation and weight bytes cross, each a serial resource of the step.
LINKS: tuple[str, ...] = ("h2d", "d2h", "nvme_read", "nvme_write")

#: Device bytes per resident parameter updated on the GPU: its host bytes (fp32 master,
#: fp32 gradient accumulator, 8-bit moments; `host.py`) moved to the device.
DEVICE_RESIDENT_BYTES_PER_PARAM = (MASTER_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM
                                   + round(OPTIMIZER_STATE_BYTES_PER_PARAM["hybrid8bit"]))
#: The GPU update's temporaries: 64 bytes per element of one chunk, the largest resident
#: tensor or `DEVICE_UPDATE_CHUNK_ELEMENTS` elements, whichever is smaller: about twice
#: what its torch path was measured to peak at (docs/benchmarks.md "Optimizer"), the rest
#: room for the caching allocator.
DEVICE_UPDATE_BYTES_PER_ELEMENT = 64

DEVICE_RESIDENT_TERM = ("the residents' fp32 masters, gradients and 8-bit Adam state (updated "
                        "on the GPU)")

#: Device memory set aside for the CUDA context, cuBLAS workspaces and allocator
#: fragmentation: the plan never fills the GPU budget to the last byte.
GPU_RESERVE_FRACTION = 0.04

#: Boundaries in flight between tiers at once (one being offloaded, one reloaded): they
#: sit on the device beside the GPU-homed ones while their copy runs, and NVMe
#: boundaries sit in host memory between their D2H and their write (and read and H2D).
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

    @property
    def gpu_reserve_bytes(self) -> int:
        """Device bytes no plan fills (`GPU_RESERVE_FRACTION` of the GPU budget)."""
        return int(GPU_RESERVE_FRACTION * self.gpu_bytes)


@dataclass(kw_only=True, frozen=True)
class Problem:
    """Numbers of one planning instance, in bytes and seconds."""

    num_layers: int
    max_block: int  # K: longest recompute block (edge length)
    boundary_bytes: int  # A
    layer_param_bytes: int  # P, one layer's weights as streamed H2D
    layer_grad_bytes: int  # G, one layer's weight gradients streamed D2H
    fwd_s: float  # one layer forward (with the dequantization of packed weights, if any)
    bwd_s: float  # one layer backward proper (its forward re-run is added separately)
    head_s: float  # final norm + head + loss, forward and backward
    # The engine's overhead per layer run beyond its compute: a forward run (a forward or
    # a recompute re-run) and a backward run (re-run with grad + backward).
    fwd_overhead_s: float = 0.0
    bwd_overhead_s: float = 0.0
    # What a step costs once besides its layer runs and the head's FLOPs (embedding,
    # masks, loss and optimizer calls), charged in F_L beside the head.
    step_overhead_s: float = 0.0
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    static_gpu_bytes: int  # everything on the device that is not a boundary activation
    # static_gpu_bytes term by term, largest first, as refusals name them.
    gpu_base_terms: tuple[tuple[str, int], ...] = ()
    static_cpu_bytes: int  # host bytes that are not boundary activations
    # static_cpu_bytes term by term, largest first, as refusals name them.
    cpu_base_terms: tuple[tuple[str, int], ...] = ()
    tail_d2h_bytes: int  # gradients that leave after the last backward window
    budgets: Budgets
    # Offloaded boundaries on the device while their copy runs; `make_plan` raises it when
    # the simulated step shows more in flight (saturated links).
    staging_boundaries: int = STAGING_BOUNDARIES
    # NVMe boundaries in host memory at once on their way to and from the file;
    # `make_plan` raises it when the simulated host peak shows more (slow NVMe).
    host_staging_boundaries: int = STAGING_BOUNDARIES
    param_count: int
    tokens_per_step: int
    # Parameters the host optimizer updates: per layer and resident (trainable only; a
    # LoRA run updates its adapters, not the frozen base).
    layer_update_param_count: int = 0
    resident_update_param_count: int = 0
    # Of those, the output side's (final norm, untied head), updated after the layers.
    head_update_param_count: int = 0
    # "device": the residents' masters and moments live on the GPU and their update runs
    # there (`device_update_s`) before the next forward, their gradients never leave it.
    resident_update: str = "host"
    device_update_s: float = 0.0
    # The host optimizer `cpu_base_terms` prices (`host.OPTIMIZERS`).
    optimizer: str = "hybrid8bit"
    # The training thread's work per transfer (`HardwareProfile.host_stage_bytes_per_s`,
    # `host_fold_bytes_per_s`; 0: not priced): one layer's weights cast into a staging
    # buffer before their H2D copy (S), one layer's gradients folded into `.grad` after
    # their D2H copy (Fd); on a synchronous device (a CPU) the copies themselves, at the
    # links' rates (`build_problem`). With `host_on_compute` (a CPU or emulated device) that work
    # takes the compute's time; on a GPU it runs beside the queued kernels, which wait for
    # it only when the host falls behind.
    stage_s: float = 0.0
    fold_s: float = 0.0
    host_on_compute: bool = False
    # The drive reads and writes at once (`HardwareProfile.nvme_full_duplex`); False: the
    # update phase's state reads and writes take turns on it.
    nvme_full_duplex: bool = True
    # Local ranks sharing the node's host (`node.py`): each runs this plan, so each rank's
    # own host terms count this many times; the link rates are already their shares.
    gpus_per_node: int = 1
    # The launch's nodes and how the host state spreads over them (`node.NODE_LAYOUTS`):
    # split, each node holds 1/K of the gradients and optimizer state (`state_shards`).
    nodes: int = 1
    node_layout: str = "replicated"
    # One decoder layer's host state by part (`state.py`), which parts of which layers
    # live on NVMe (`StateHomes`; `cpu_base_terms` are net of them), and the host terms
    # with every part in DRAM (what `with_state_homes` starts from).
    state_sizes: StateSizes = field(default_factory=lambda: StateSizes(
        optimizer_bytes=0, grads_bytes=0, copies_bytes=0))
    state: StateHomes = field(default_factory=StateHomes)
    dram_cpu_base_terms: tuple[tuple[str, int], ...] = ()
    # Whether the MIP decides the state's homes (`milp._add_state`: where the state does
    # not fit DRAM) rather than taking `state` as given.
    decide_state: bool = False
    # The parts the state's homes may put on NVMe (`plan.STATE_PARTS`, or fewer: a run
    # plans only what its engine streams); the MIP charges their buffers where it decides.
    state_parts: tuple[str, ...] = STATE_PARTS
    # One share's host update rate (`node.share_update_params_per_s`): the update phase's
    # seconds, which the simulator prices and the MIP too where it decides the state.
    update_params_per_s: float = 0.0
    # Whether the device's work runs beside the host's (a GPU): the residents' update on
    # the device then runs beside the host's layers rather than before them.
    device_runs_async: bool = True

    # ---- windows -------------------------------------------------------------------
    @property
    def num_windows(self) -> int:
        return 2 * self.num_layers

    @property
    def fwd_run_s(self) -> float:
        """One forward run of a layer (a forward or a recompute re-run): its compute and
        the engine's per-run overhead."""
        return self.fwd_s + self.fwd_overhead_s

    @property
    def bwd_run_s(self) -> float:
        """One backward run of a layer: its forward re-run with grad, its backward, and
        the engine's per-run overhead."""
        return self.fwd_s + self.bwd_s + self.bwd_overhead_s

    def overhead_s(self, recompute_runs: int = 0) -> float:
        """The overhead of a step (part of the windows' durations): L forward runs, L
        backward runs, `recompute_runs` re-runs, and the step's own."""
        return (self.num_layers + recompute_runs) * self.fwd_overhead_s \
            + self.num_layers * self.bwd_overhead_s + self.step_overhead_s

    def base_duration_s(self, window: int) -> float:
        """Compute seconds of a window without recompute. The head (and the step's own
        overhead) ends the last forward window: the engine issues window L's transfers at
        the first backward run, after the head, and nothing waits at the head for those
        the last forward issued (the first backward's weights)."""
        L = self.num_layers
        if window < L:
            return self.fwd_run_s + (self.head_s + self.step_overhead_s if window == L - 1
                                     else 0.0)
        return self.bwd_run_s

    def recompute_s(self, s: int, e: int) -> float:
        """R[s,e]: re-running layers s+1..e-1 forward, at the start of window B_e."""
        return (e - s - 1) * self.fwd_run_s

    def restream_stall_s(self, s: int, e: int) -> float:
        """Recompute waits for weights: layer k+1's re-stream starts with layer k's re-run,
        so each of the last n-2 re-runs waits max(0, P/h2d - f)."""
        stall = self.layer_param_bytes / self.h2d_bytes_per_s - self.fwd_run_s
        return max(e - s - 2, 0) * max(stall, 0.0)

    def block_cost_s(self, s: int, e: int) -> float:
        """Seconds block (s, e) adds to the step: recompute plus re-stream stall in its
        window B_e, plus the host staging its e-s-2 extra loads where the compute waits for
        it (`host_on_compute`; spread over the windows as `restream_windows` loads)."""
        return self.recompute_s(s, e) + self.restream_stall_s(s, e) + self.restream_host_s(s, e)

    def restream_host_s(self, s: int, e: int) -> float:
        """The host staging of block (s, e)'s extra loads, where it takes the compute's
        time (`host_on_compute`), else 0."""
        return max(e - s - 2, 0) * self.stage_s if self.host_on_compute else 0.0

    def weight_h2d_bytes(self, window: int) -> int:
        """Weights prefetched for the next window's layer (none when it is the same layer)."""
        L = self.num_layers
        return 0 if window in (forward_window(L, L), backward_window(1, L)) \
            else self.layer_param_bytes

    def grad_d2h_bytes(self, window: int) -> int:
        """Gradients of the previous backward layer leave while this window computes."""
        return self.layer_grad_bytes if window > backward_window(self.num_layers,
                                                                 self.num_layers) else 0

    def restream_windows(self, s: int, e: int) -> tuple[tuple[int, int], ...]:
        """(window, bytes) of the weight re-stream block (s,e) costs: the first recomputed
        layer is prefetched in the window before B_e, the others stream during B_e's
        recompute; the last two re-run layers are still in their buffers when their
        backward comes (B_{e-1}, B_{e-2}), so the windows B_e and B_{e-1} load them no
        more (negative bytes against `weight_h2d_bytes`)."""
        n, w, P = e - s, backward_window(e, self.num_layers), self.layer_param_bytes
        if n < 2:
            return ()
        return ((w - 1, P), (w, (n - 3) * P), (w + 1, -P if n >= 3 else 0))

    def window_durations_s(self, edges: Mapping[tuple[int, int], Any]) -> list[Any]:
        """Per window, compute seconds (with the host's work per transfer where it runs on
        the compute's thread, `host_on_compute`); `edges` maps chosen blocks to their
        weight (1 for a fixed plan, a binary variable in the MIP)."""
        dur: list[Any] = [self.base_duration_s(w) for w in range(self.num_windows)]
        for (s, e), x in edges.items():
            if e - s >= 2:
                w = backward_window(e, self.num_layers)
                dur[w] = dur[w] + (self.recompute_s(s, e) + self.restream_stall_s(s, e)) * x
        if self.host_on_compute:  # window w+1's host work ends window w: the engine does it
            # before it waits for the run's weights, beside the copies still in flight
            host = self.host_window_s(edges)
            dur = [d + h for d, h in zip(dur, [*host[1:], 0.0], strict=True)]
        return dur

    def fold_in(self, window: int) -> int | None:
        """The layer whose gradients the host folds into `.grad` at the start of `window`,
        if any: the engine's two staging buffers take turns, so putting layer k's
        gradients (after B_k, in B_{k-1}'s window) first folds layer k+2's: layer m's in
        B_{m-3}'s window; layers 1..3 fold after the last window (`host_tail_s`)."""
        L = self.num_layers
        first_backward = backward_window(L, L)
        if window < first_backward:
            return None
        layer = L - (window - first_backward) + 3  # window runs B_{layer-3}
        return layer if layer <= L else None

    def host_window_s(self, edges: Mapping[tuple[int, int], Any]) -> list[Any]:
        """Per window, the host's work per transfer (weighted like `window_durations_s`):
        staging the weights the window loads (prefetches and re-streams), folding the
        gradients it folds (`fold_in`)."""
        weights = self.mandatory_bytes(edges)["h2d"]
        return [self._host_s(w, nbytes) for w, nbytes in enumerate(weights)]

    def _host_s(self, window: int, h2d_bytes: Any) -> Any:
        """The host's work in `window` that loads `h2d_bytes` of weights (`host_window_s`)."""
        return (h2d_bytes * (self.stage_s / self.layer_param_bytes)
                + (self.fold_s if self.fold_in(window) is not None else 0.0))

    def block_windows(self, block: tuple[int, int]) -> range:
        """The windows whose duration or weight bytes block `block` changes: its re-stream
        windows (`restream_windows`: B_e's and the two beside it) and, where the host's
        staging runs on the compute's thread, the window before each (it ends that one)."""
        w = backward_window(block[1], self.num_layers)
        return range(max(w - 2, 0), min(w + 2, self.num_windows))

    def one_block_window(self, block: tuple[int, int], window: int) -> tuple[float, int]:
        """`window_durations_s({block: 1})[window]` and `mandatory_bytes({block: 1})["h2d"]
        [window]`, the same floats, without the other windows: `milp._free_deltas_s` asks
        this for every block at the hop windows among its `block_windows`."""
        s, e = block
        restream = {w: nbytes for w, nbytes in self.restream_windows(s, e) if nbytes}

        def h2d(w: int) -> int:  # the weight 1 of the whole-list functions: exact as is
            return self.weight_h2d_bytes(w) + restream.get(w, 0)

        dur = self.base_duration_s(window)
        if e - s >= 2 and window == backward_window(e, self.num_layers):
            dur = dur + (self.recompute_s(s, e) + self.restream_stall_s(s, e))
        if self.host_on_compute:
            dur = dur + (self._host_s(window + 1, h2d(window + 1))
                         if window + 1 < self.num_windows else 0.0)
        return dur, h2d(window)

    @property
    def host_tail_s(self) -> float:
        """The folds after the last window (layers 1..3, or all of fewer): the training
        thread's drain at the end of the backward, after the last gradients' copy."""
        return min(3, self.num_layers) * self.fold_s

    def mandatory_bytes(self, edges: Mapping[tuple[int, int], Any],
                        state: StateWeights | None = None) -> dict[str, list[Any]]:
        """Per link and window, the bytes that move whatever the boundaries' homes:
        weights (and the re-stream of recompute blocks, weighted like
        `window_durations_s`), gradients, and the NVMe-homed host state's gradient writes
        and copy reads (`state`: the MIP's weights; default this problem's homes)."""
        W = self.num_windows
        h2d: list[Any] = [self.weight_h2d_bytes(w) for w in range(W)]
        for (s, e), x in edges.items():
            for w, nbytes in self.restream_windows(s, e):
                if nbytes:
                    h2d[w] = h2d[w] + nbytes * x
        nvme = backward_state_bytes(weights_of(self.state) if state is None else state,
                                    self.state_sizes, self.num_layers, folds=self.fold_s > 0)
        return {"h2d": h2d, "d2h": [self.grad_d2h_bytes(w) for w in range(W)], **nvme}

    @property
    def nvme_state_bytes(self) -> int:
        """NVMe bytes the host state's homes take."""
        return nvme_state_bytes(weights_of(self.state), self.state_sizes)

    @property
    def first_update_s(self) -> float:
        """The update phase's first op: the residents' update on the GPU, or the input
        side's on the host (U_device, U_embed in `simulate.py`)."""
        if self.resident_update == "device":
            return self.device_update_s
        return (self.resident_update_param_count - self.head_update_param_count) \
            / self.update_params_per_s

    @property
    def layer_update_s(self) -> float:
        """One layer's host update (U_j)."""
        return self.layer_update_param_count / self.update_params_per_s

    @property
    def head_update_s(self) -> float:
        """The output side's host update (U_head; none when the GPU updates it)."""
        return (self.head_update_param_count / self.update_params_per_s
                if self.resident_update == "host" else 0.0)

    def edges(self) -> list[tuple[int, int]]:
        """The MIP's candidate blocks: up to K layers long, none re-running a layer whose
        compute copy lives on NVMe (its re-run would read the file again, `state.py`)."""
        L, K = self.num_layers, self.max_block
        copies = set(self.state.copies)
        return [(s, e) for s in range(L) for e in range(s + 1, min(s + K, L) + 1)
                if not copies.intersection(range(s + 1, e))]

    # ---- links -----------------------------------------------------------------------
    def rate_bytes_per_s(self, link: str) -> float:
        return {"h2d": self.h2d_bytes_per_s, "d2h": self.d2h_bytes_per_s,
                "nvme_read": self.nvme_read_bytes_per_s,
                "nvme_write": self.nvme_write_bytes_per_s}[link]

    @staticmethod
    def moves_on(link: str, home: Home) -> bool:
        """Whether a boundary homed `home` crosses `link` (PCIe: CPU and NVMe homes)."""
        return home == Home.NVME or (home == Home.CPU and not link.startswith("nvme"))

    def transfer_windows(self, link: str, i: int, home: Home = Home.CPU) -> tuple[int, int]:
        """Inclusive window range in which boundary i, homed `home`, may cross `link`
        (empty when lo > hi).

        A CPU boundary leaves after F_i (D2H in F_{i+1}..F_L) and is back before B_{i+1}
        reads it (H2D in B_L..B_{i+2}). An NVMe boundary's PCIe hops take one window each,
        D2H in F_{i+1} and H2D in B_{i+2}, so its NVMe write (F_{i+2}..F_L) and read
        (B_L..B_{i+3}) are always in other windows: a hop never starts before the one it
        needs ended, whatever the MIP chose. The windows of each link form a laminar
        family (nested suffixes or prefixes, and single windows inside them), which is
        what makes the MIP's Hall rows exact."""
        L = self.num_layers
        last_forward, first_backward = forward_window(L, L), backward_window(L, L)
        reader = backward_window(min(i + 1, L), L)
        if home == Home.NVME and link in ("d2h", "h2d"):
            return (i, i) if link == "d2h" else (reader - 1, reader - 1)
        return {"d2h": (i, last_forward), "nvme_write": (i + 1, last_forward),
                "h2d": (first_backward, reader - 1),
                "nvme_read": (first_backward, reader - 2)}[link]

    def can_offload(self, i: int, nvme: bool = False) -> bool:
        """Whether boundary i has a window to leave and a window to come back in."""
        if i in (0, self.num_layers):
            return False
        home, links = (Home.NVME, LINKS) if nvme else (Home.CPU, ("d2h", "h2d"))
        return all(lo <= hi for lo, hi in (self.transfer_windows(k, i, home) for k in links))

    # ---- constants of the step -------------------------------------------------------
    @property
    def prologue_s(self) -> float:
        """Layer 1's weights arrive (staged, then copied) before anything can run; where
        the host is the compute's thread, its first window's work (staging layer 2) runs
        beside that copy."""
        first_s = self.host_window_s({})[0] if self.host_on_compute else 0.0
        return self.stage_s + max(self.layer_param_bytes / self.h2d_bytes_per_s, first_s)

    @property
    def tail_s(self) -> float:
        return self.tail_d2h_bytes / self.d2h_bytes_per_s

    @property
    def compute_s(self) -> float:
        return sum(self.base_duration_s(w) for w in range(self.num_windows))

    @property
    def host_s(self) -> float:
        """The host's work per transfer that a step without blocks waits for: every
        window's but the first where it takes the compute's time (`host_on_compute`), and
        the tail's drain (the prologue's staging and the first window's are in
        `prologue_s`)."""
        windows_s = sum(self.host_window_s({})[1:]) if self.host_on_compute else 0.0
        return windows_s + self.host_tail_s

    @property
    def state_shards(self) -> int:
        """The parts each node's gradients and optimizer state are cut into (`node.py`)."""
        return state_shards(self.node_layout, self.nodes)

    @property
    def host_update_param_count(self) -> int:
        """Parameters the node's host updates each step (P_u): every layer's, and the
        residents' unless the GPU updates them; their 1/K under the split layout."""
        residents = self.resident_update_param_count if self.resident_update == "host" else 0
        return -(-(self.num_layers * self.layer_update_param_count + residents)
                 // self.state_shards)

    @property
    def gpu_reserve_bytes(self) -> int:
        return self.budgets.gpu_reserve_bytes

    @property
    def gpu_fixed_bytes(self) -> int:
        """Device bytes the MIP charges besides GPU homes and the block cache."""
        staging = self.staging_boundaries * self.boundary_bytes
        return self.static_gpu_bytes + staging + self.gpu_reserve_bytes

    @property
    def cpu_fixed_bytes(self) -> int:
        """Host bytes charged besides CPU homes: the static bytes and the NVMe staging."""
        return sum(b for _, b in self.host_terms(cpu=0))

    def host_terms(self, *, cpu: Any, nvme_staging: Any = 1, state: StateWeights | None = None
                   ) -> tuple[tuple[str, Any], ...]:
        """Every host term of a run with `cpu` boundaries homed in DRAM (a count or the
        MIP's sum), NVMe bounce buffers times `nvme_staging` (the MIP charges them always),
        and the host state homed as `state` says (the MIP's weights, with the state's
        buffers charged; default this problem's homes)."""
        base = self.cpu_base_terms if state is None else host_terms_with_state(
            self.dram_cpu_base_terms, state, self.state_sizes, staged=self.state_parts,
            ranks=self.gpus_per_node, shards=self.state_shards)
        return (*base, *activation_host_terms(
            boundary_bytes=self.boundary_bytes, cpu_homes=cpu,
            staging_boundaries=self.host_staging_boundaries, nvme_staging=nvme_staging,
            ranks=self.gpus_per_node))

    def tier_need_bytes(self, *, gpu: Any, cache: Any, cpu: Any, nvme: Any,
                        state: StateWeights | None = None) -> dict[str, Any]:
        """Bytes each tier needs for `gpu`/`cpu`/`nvme` homed boundaries and a block cache
        of `cache` boundaries (longest block - 1): counts or the MIP's sums of variables;
        the host state homed as `state` says (default this problem's homes)."""
        A = self.boundary_bytes
        state_nvme = self.nvme_state_bytes if state is None else nvme_state_bytes(
            state, self.state_sizes)
        return {"gpu": self.gpu_fixed_bytes + A * (gpu + cache),
                "cpu": sum(b for _, b in self.host_terms(cpu=cpu, state=state)),
                "nvme": A * nvme + state_nvme}

    def budget_bytes(self, tier: str) -> int:
        return {"gpu": self.budgets.gpu_bytes, "cpu": self.budgets.cpu_bytes,
                "nvme": self.budgets.nvme_bytes}[tier]

    def fixed_bytes(self, tier: str) -> int:
        """The part of a tier's need that no home changes (the base of a refusal)."""
        return {"gpu": self.gpu_fixed_bytes, "cpu": self.cpu_fixed_bytes,
                "nvme": self.nvme_state_bytes}[tier]

    def step_floor_s(self) -> float:
        """Step seconds no plan avoids: compute, layer 1's weights, the last gradients.
        A plan's step is this plus its objective (recompute, stalls, exposure)."""
        return self.compute_s + self.prologue_s + self.tail_s + self.host_s


def weight_buffer_count(max_block: int) -> int:
    """Device weight buffers for recompute blocks of up to `max_block` layers (the engine's
    `WeightPool` slots): the running layer and the next one, plus, when a block re-runs
    layers, the first re-run layer prefetched beside the block's last layer."""
    return 3 if max_block >= 2 else 2


def build_problem(model: ModelProfile, hardware: HardwareProfile, *,
                  budgets: Budgets | None = None, max_recompute_block: int = 8,
                  resident_update: str = "host", optimizer: str = "hybrid8bit",
                  gpus_per_node: int = 1, nodes: int = 1, node_layout: str = "replicated",
                  state: StateHomes | None = None) -> Problem:
    """The instance for `model` at its batch shape on `hardware` under `budgets`, with the
    residents' update on the host or the GPU (`resident_update`, `RESIDENT_UPDATES`) and
    the host state of `optimizer` (`host.OPTIMIZERS`), for one of `gpus_per_node` ranks
    sharing the host (`node.py`: `budgets.cpu_bytes` is the node's) on each of `nodes`
    holding the state as `node_layout` says (`node.NODE_LAYOUTS`), the layers' host
    state homed as `state` says (None: all in DRAM; `with_state_homes`)."""
    check_optimizer(optimizer)
    check_node_shape(gpus_per_node=gpus_per_node, nodes=nodes)
    if node_layout not in NODE_LAYOUTS:
        raise ValueError(f"node_layout={node_layout!r} is not one of {NODE_LAYOUTS}")
    shards = state_shards(node_layout, nodes)
    if resident_update not in RESIDENT_UPDATES:
        raise ValueError(f"resident_update={resident_update!r} is not one of "
                         f"{RESIDENT_UPDATES}")
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
    weight_buffers = weight_buffer_count(K)
    terms = sorted([*device_working_terms(model),
                    (f"{weight_buffers} layer weight buffers",
                     weight_buffers * model.layer_param_bytes),
                    ("2 gradient buffers", 2 * model.layer_grad_bytes),
                    ("resident embeddings/head and their gradients",
                     model.resident_param_bytes + model.resident_grad_bytes)],
                   key=lambda t: -t[1])
    on_device = resident_update == "device"
    resident_trainable = model.resident_trainable_param_count if on_device else 0
    if on_device:
        terms = sorted([*terms, (DEVICE_RESIDENT_TERM, resident_trainable
                                 * DEVICE_RESIDENT_BYTES_PER_PARAM),
                        ("the GPU update's chunk buffers", device_update_workspace_bytes(
                            model))],
                       key=lambda t: -t[1])
    params = model.geometry.total_param_count
    host_terms = host_base_terms(model, optimizer=optimizer, weight_slots=weight_buffers,
                                 resident_update=resident_update, ranks=gpus_per_node,
                                 shards=shards)
    # A packed (QLoRA) layer dequantizes its linears on the device once per pass: in its
    # forward (so also in each re-run) and in its backward proper.
    dequant_s = (0.0 if model.weights is None else model.weights.layer_dequant_bytes(
        model.compute_bytes_per_elem) / hardware.dequant_bytes_per_s)
    tile_fwd_s, tile_bwd_s = tile_overhead_s(
        batch_size=model.batch_size, seq_len=model.seq_len,
        tile_tokens=model.tile_tokens or 0, attention_block_tokens=model.attention_block_tokens)
    # The engine stages and folds on an async device. A synchronous one (a CPU) copies a
    # layer's weights in and its gradients out on the training thread, so the copies
    # themselves are that thread's work per transfer, at the links' rates.
    stage_bytes_per_s, fold_bytes_per_s = (
        (hardware.host_stage_bytes_per_s, hardware.host_fold_bytes_per_s)
        if hardware.device_runs_async else (hardware.h2d_bytes_per_s, hardware.d2h_bytes_per_s))
    problem = Problem(
        num_layers=model.num_layers, max_block=K, boundary_bytes=model.boundary_bytes,
        layer_param_bytes=model.layer_param_bytes, layer_grad_bytes=model.layer_grad_bytes,
        fwd_s=model.layer_fwd_flops / flops_per_s + dequant_s + tile_fwd_s,
        bwd_s=(model.layer_bwd_flops + key_pass_flops(
            model.geometry, batch_size=model.batch_size, seq_len=model.seq_len,
            attention_block_tokens=model.attention_block_tokens)) / flops_per_s
        + dequant_s + tile_bwd_s,
        head_s=3.0 * model.head_fwd_flops / flops_per_s,  # backward ~ 2x forward
        fwd_overhead_s=hardware.layer_forward_overhead_s,
        bwd_overhead_s=hardware.layer_backward_overhead_s,
        step_overhead_s=hardware.step_overhead_s,
        h2d_bytes_per_s=hardware.h2d_bytes_per_s, d2h_bytes_per_s=hardware.d2h_bytes_per_s,
        nvme_read_bytes_per_s=hardware.nvme_read_bytes_per_s,
        nvme_write_bytes_per_s=hardware.nvme_write_bytes_per_s,
        static_gpu_bytes=sum(b for _, b in terms), gpu_base_terms=tuple(terms),
        static_cpu_bytes=sum(b for _, b in host_terms), cpu_base_terms=host_terms,
        tail_d2h_bytes=model.layer_grad_bytes + resident_tail_d2h_bytes(model, on_device=on_device),
        budgets=budgets, param_count=params, tokens_per_step=model.tokens_per_step,
        layer_update_param_count=model.layer_trainable_param_count,
        resident_update_param_count=model.resident_trainable_param_count,
        head_update_param_count=head_update_param_count(model),
        resident_update=resident_update,
        device_update_s=resident_trainable / hardware.gpu_optimizer_params_per_s,
        optimizer=optimizer, gpus_per_node=gpus_per_node, nodes=nodes, node_layout=node_layout,
        stage_s=_host_work_s(model.layer_param_bytes, stage_bytes_per_s),
        fold_s=_host_work_s(model.layer_grad_bytes, fold_bytes_per_s),
        host_on_compute=hardware.compute_on_host,
        nvme_full_duplex=hardware.nvme_full_duplex,
        state_sizes=layer_state_sizes(model, optimizer, shards=shards),
        dram_cpu_base_terms=host_terms,
        # each share's update covers 1/K of its layers' parameters on a split node
        update_params_per_s=share_update_params_per_s(hardware, gpus_per_node) * shards,
        device_runs_async=hardware.device_runs_async,
    )
    return with_state_homes(with_node_links(problem, hardware), state or StateHomes())


def layer_state_sizes(model: ModelProfile, optimizer: str, *, shards: int = 1) -> StateSizes:
    """One decoder layer's host state by part on a node holding 1/`shards` of it
    (`node.state_shards`): what the plan homes, prints and preflight counts."""
    return state_sizes(update_param_count=model.layer_trainable_param_count,
                       optimizer=optimizer, copy_bytes=layer_copy_bytes(model, optimizer),
                       shards=shards, master_shards=master_shards(model, optimizer, shards))


def layer_copy_bytes(model: ModelProfile, optimizer: str) -> int:
    """One layer's compute-dtype copy the hybrid update writes (`host.py`'s term per layer)."""
    if not writes_compute_copies(model, optimizer):
        return 0
    packed = 0 if model.weights is None else model.weights.layer_packed_param_count
    return (model.geometry.layer_param_count - packed) * model.compute_bytes_per_elem


def with_state_homes(p: Problem, state: StateHomes) -> Problem:
    """`p` with the layers' host state homed as `state` says: the DRAM terms less what
    lives on NVMe, plus the buffers it streams through (`state.py`)."""
    terms = host_terms_with_state(p.dram_cpu_base_terms, weights_of(state), p.state_sizes,
                                  staged=homed_parts(state), ranks=p.gpus_per_node,
                                  shards=p.state_shards)
    terms = tuple(sorted(terms, key=lambda t: -t[1]))
    return replace(p, state=state, cpu_base_terms=terms,
                   static_cpu_bytes=sum(b for _, b in terms))


def _host_work_s(nbytes: int, bytes_per_s: float) -> float:
    """Seconds of host work on `nbytes` at `bytes_per_s`; 0 where the rate is not priced."""
    return nbytes / bytes_per_s if bytes_per_s > 0 else 0.0


def with_node_links(problem: Problem, hardware: HardwareProfile) -> Problem:
    """`problem` (priced at the PCIe rates) with each link at its share of the host DRAM
    that the node's updates leave, their traffic averaged over the compute-only step
    (`node.py`: `link_bytes_per_s`, `host_update_bytes_per_s`). The drives keep the
    node's rates: a node problem's update phase is the node's (every layer's state, at
    the node's update rate, `share_update_params_per_s` x N ranks each a 1/N share)."""
    update_bytes_per_s = host_update_bytes_per_s(
        hardware, update_param_count=problem.host_update_param_count,
        compute_s=problem.compute_s)

    def share(pcie_bytes_per_s: float) -> float:
        return link_bytes_per_s(pcie_bytes_per_s, hardware, problem.gpus_per_node,
                                update_bytes_per_s=update_bytes_per_s)

    return replace(problem, h2d_bytes_per_s=share(problem.h2d_bytes_per_s),
                   d2h_bytes_per_s=share(problem.d2h_bytes_per_s))


def resident_tail_d2h_bytes(model: ModelProfile, *, on_device: bool) -> int:
    """The residents' gradients that leave the device after the last backward window:
    none when they are updated on the device, or when the residents have no device copy
    (`resident_param_bytes` 0: a CPU run in fp32 uses the host masters in place, and
    autograd accumulates their `.grad` there; `engine/memory/residents.py`)."""
    if on_device or model.resident_param_bytes == 0:
        return 0
    return model.resident_grad_bytes


def device_update_workspace_bytes(model: ModelProfile) -> int:
    """Temporaries of the residents' update on the GPU: one chunk of the largest resident
    tensor (embeddings or head) at `DEVICE_UPDATE_BYTES_PER_ELEMENT`."""
    g = model.geometry
    largest = max(g.embedding_param_count, g.head_param_count, g.final_norm_param_count)
    return DEVICE_UPDATE_BYTES_PER_ELEMENT * min(largest, DEVICE_UPDATE_CHUNK_ELEMENTS)


def head_update_param_count(model: ModelProfile) -> int:
    """The output side's share (final norm, untied head) of the trainable resident
    parameters; by parameter count where only some residents train."""
    g = model.geometry
    head = g.head_param_count + g.final_norm_param_count
    resident = head + g.embedding_param_count
    return model.resident_trainable_param_count * head // resident if resident else 0
