"""Hardware profiles: capacities and rates of one GPU + host + NVMe machine.

Presets describe known GPUs with sources noted per number; `load_hardware("auto")`
(`hardware_spec.py`) measures the current machine instead (`measure.py`, torch needed only
then). This module imports nothing of the package: config validates preset names against
it, measure builds profiles with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: bitsandbytes' dequantize kernels stream (read packed, write bf16): bandwidth-bound, at
#: about this fraction of the memory bandwidth (a streaming kernel's usual share).
DEQUANT_EFFICIENCY = 0.7
#: The slowest preset's memory bandwidth (RTX 3090, 936 GB/s): the dequantization default.
_DEFAULT_MEMORY_BYTES_PER_S = 936e9
#: One 100 Gb/s NIC (a workstation's): the network rate of a profile written without one.
DEFAULT_INTERNODE_BYTES_PER_S = 12.5e9
#: The share of the theoretical DRAM bandwidth that streams reach: an estimate of STREAM
#: Triad's usual share of a 2-socket server's DDR peak (published runs land at 70-80%).
HOST_MEMORY_EFFICIENCY = 0.75
#: DRAM bytes the hybrid 8-bit host update moves per parameter (planning/host.py's state):
#: reads the fp32 gradient (4), fp32 master (4) and two 1-byte moments (2), writes the
#: master (4), the moments (2) and the bf16 compute copy (2).
HOST_UPDATE_BYTES_PER_PARAM = 18
#: The fraction of a STREAM-like triad's bandwidth that the hybrid 8-bit update reaches
#: when it streams from DRAM, by the kernel variant the host CPU runs (the dispatch picks
#: by the CPU's features, docs/optimizer.md). Measured on 2 threads of a VM, so an
#: estimate for a server's cores; no Arm host has a figure, so no preset has an Arm host.
#: The run and its figures: docs/benchmarks.md "The presets' host update rate".
HOST_UPDATE_TRIAD_FRACTION: dict[str, float] = {"avx512": 0.83, "avx2": 0.63}
#: Pageable over pinned host<->device copy rate where none was measured: MegaTrain's
#: figures for one GPU, ~14 GB/s H2D from pageable memory against ~21 GB/s pinned (the
#: driver stages pageable copies through its own pinned buffer, a second memcpy).
PAGEABLE_SHARE = 14 / 21
#: Bytes the 8-bit update's torch path (the one a GPU master takes, `optim/reference.py`)
#: reads and writes per parameter: its 76 elementwise and per-block ops counted tensor by
#: tensor (bf16 gradient, clipped; tests/optim/test_device_update.py counts them again).
DEVICE_UPDATE_BYTES_PER_PARAM = 507
#: A GPU's per-layer-run overhead (`HardwareProfile.layer_forward_overhead_s`,
#: `layer_backward_overhead_s`) where none was measured: an estimate, not a measurement.
#: The engine waits on an event before each layer run (its weights), so the device idles
#: while the host issues the run's first kernels: about ten launches at the few
#: microseconds of host time a CUDA kernel launch costs, plus the engine's Python around
#: the run; a backward run (its re-run with grad, then the backward and the gradient
#: hand-off) about twice that. The rest of the host's work overlaps the device's.
GPU_LAYER_FORWARD_OVERHEAD_S = 1e-4
GPU_LAYER_BACKWARD_OVERHEAD_S = 2e-4
#: The same for the step's own work besides its layers (`step_overhead_s`): the model's
#: embedding, mask, head and loss calls and the optimizer call, a few hundred launches'
#: worth of host time, mostly hidden behind the device's work: an estimate.
GPU_STEP_OVERHEAD_S = 1e-3
#: How `load_hardware("auto")` names what it measured (`measure.py`): its host update rate
#: is the one the optimizer really runs at here, kernel or torch path.
MEASURED_NAME_PREFIX = "measured-"
#: Fields that may be 0 (a cost that a machine may not have); every other number is > 0.
_MAY_BE_ZERO = frozenset({"layer_forward_overhead_s", "layer_backward_overhead_s",
                          "step_overhead_s", "host_stage_bytes_per_s",
                          "host_fold_bytes_per_s"})


def device_update_params_per_s(memory_bytes_per_s: float) -> float:
    """The residents' update on the GPU, bandwidth-bound at the streaming share."""
    return DEQUANT_EFFICIENCY * memory_bytes_per_s / DEVICE_UPDATE_BYTES_PER_PARAM


def host_update_params_per_s(host_memory_bytes_per_s: float, host_isa: str) -> float:
    """The host's 8-bit update, bandwidth-bound: the triad's share of the theoretical DRAM
    bandwidth (`HOST_MEMORY_EFFICIENCY`) x the fraction of the triad the kernel variant
    for `host_isa` reaches (`HOST_UPDATE_TRIAD_FRACTION`), over the bytes it moves a
    parameter."""
    if host_isa not in HOST_UPDATE_TRIAD_FRACTION:
        raise ValueError(f"host_isa={host_isa!r} has no measured kernel fraction; give one "
                         f"of {sorted(HOST_UPDATE_TRIAD_FRACTION)}")
    return (host_memory_bytes_per_s * HOST_MEMORY_EFFICIENCY
            * HOST_UPDATE_TRIAD_FRACTION[host_isa] / HOST_UPDATE_BYTES_PER_PARAM)


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
    # bitsandbytes dequantization on the device, in bytes moved: packed weights and scales
    # read + their compute-dtype copy written (a packed linear dequantizes per call). The
    # default, for profiles written without it, is the slowest preset's (rtx3090).
    dequant_bytes_per_s: float = DEQUANT_EFFICIENCY * _DEFAULT_MEMORY_BYTES_PER_S
    # The residents' (embeddings, head) 8-bit update on the GPU when the plan keeps their
    # masters and moments there (`Plan.resident_update`); same default rule.
    gpu_optimizer_params_per_s: float = device_update_params_per_s(_DEFAULT_MEMORY_BYTES_PER_S)
    # The host's DRAM bandwidth, theoretical (channels x transfer rate x 8 bytes, all
    # sockets): the GPUs of one node share it for their H2D/D2H streams and their host
    # updates (planning/node.py). None (a profile written without it, a measured one):
    # `host_memory_or_default()`.
    host_memory_bytes_per_s: float | None = None
    # Work queued on the device runs while the host goes on (a GPU). False where the
    # "device" is this CPU: its work, the residents' update included, runs on the training
    # thread, so the host's layer update starts only after it.
    device_runs_async: bool = True
    # Seconds a layer's forward run (a forward or a recompute re-run) and its backward run
    # (re-run with grad + backward) cost beyond the compute the engine times for it: the
    # engine's work around each run (weights acquired, prefetch issued, boundary placed,
    # gradients handed off) and the Python between layers, which no FLOP count prices.
    # Measured on this machine by `layer_probe.py`; presets and profiles written
    # without them take the GPU estimate above.
    layer_forward_overhead_s: float = GPU_LAYER_FORWARD_OVERHEAD_S
    layer_backward_overhead_s: float = GPU_LAYER_BACKWARD_OVERHEAD_S
    # Seconds a step costs once besides its layer runs and the FLOPs of its head: the
    # model's own calls around the layers (embedding, masks, head, loss), the engine's
    # per-pass hooks and the optimizer call on the training thread. Same sources.
    step_overhead_s: float = GPU_STEP_OVERHEAD_S
    # The copy rates from and to pageable host memory: what the links run at when the node
    # store cannot be page-locked (`engine/device/pinning.py`). None (a profile written without
    # them): `PAGEABLE_SHARE` of the pinned rates (`pageable_links`).
    h2d_pageable_bytes_per_s: float | None = None
    d2h_pageable_bytes_per_s: float | None = None
    # The training thread's own work per transfer on an async device (engine/stats.py
    # `HOST_WORK_KINDS`), in bytes of the device copy a second: a layer's weights cast
    # into a pinned staging buffer before their H2D copy, a layer's gradients folded from
    # theirs into `.grad` (with their norms) after their D2H copy. Measured on this
    # machine (`measure.py`) and calibrated by each run; 0 (presets, profiles written
    # without them): not priced.
    host_stage_bytes_per_s: float = 0.0
    host_fold_bytes_per_s: float = 0.0
    # The device's compute runs on the training thread (a CPU device, the emulated async
    # device): the host's work per transfer then takes the compute's time; on a GPU it
    # runs beside the queued kernels, and the device waits only when the host falls behind.
    compute_on_host: bool = False
    # The node's network to the other nodes, all its NICs together, one direction: what
    # the collectives across nodes run at (planning/node.py "network"). The default, for
    # profiles written without it, is the slowest preset's (one 100 Gb/s NIC).
    internode_bytes_per_s: float = DEFAULT_INTERNODE_BYTES_PER_S
    # Whether the NVMe drive reads and writes at once at their own rates (True: presets,
    # profiles written without it) or shares one bandwidth between them (a drive that ran
    # a read beside a write in the time of both in turn: `measure.py` times it). The
    # update phase's state reads and writes are then priced on one lane.
    nvme_full_duplex: bool = True
    # The NVMe drives the rates above are the sum of: one per directory of `nvme_dir` on
    # its own file system (`storage/drives.py`; `measure.py` counts them), or 1 for a
    # single drive or a RAID mount (whose measured rates are the array's).
    nvme_drives: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.type.endswith("| None"):
                continue
            if f.type in ("str",):
                if not isinstance(value, str):
                    raise ValueError(f"hardware profile field {f.name}={value!r} must be a "
                                     "string")
                continue
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"hardware profile field {f.name}={value!r} must be "
                                     "true or false")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"hardware profile field {f.name}={value!r} must be a number")
            if f.name == "nvme_drives" and not isinstance(value, int):
                raise ValueError(f"hardware profile field {f.name}={value!r} must be a "
                                 "whole number of drives")
            if f.name in _MAY_BE_ZERO:
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"hardware profile {self.name!r}: {f.name}={value!r} "
                                     "must be a finite number >= 0")
                continue
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"hardware profile {self.name!r}: {f.name}={value!r} must be "
                                 "a finite number > 0")

    def host_memory_or_default(self) -> float:
        """`host_memory_bytes_per_s`, or without it the default rule: what one GPU's faster
        link in both directions at once and the host update need, over
        `HOST_MEMORY_EFFICIENCY` (a profile without the figure was written for one GPU:
        the host never bound it there, and it still does not)."""
        if self.host_memory_bytes_per_s is not None:
            return self.host_memory_bytes_per_s
        link = max(self.h2d_bytes_per_s, self.d2h_bytes_per_s)
        update = self.cpu_optimizer_params_per_s * HOST_UPDATE_BYTES_PER_PARAM
        return (2 * link + update) / HOST_MEMORY_EFFICIENCY

    def pageable_links(self) -> HardwareProfile:
        """This profile with the pageable copy rates as its H2D and D2H rates: what a plan
        is priced with when the host copy could not be page-locked."""
        return dataclasses.replace(
            self, name=f"{self.name} (pageable copies)",
            h2d_bytes_per_s=self.h2d_pageable_bytes_per_s or PAGEABLE_SHARE * self.h2d_bytes_per_s,
            d2h_bytes_per_s=self.d2h_pageable_bytes_per_s or PAGEABLE_SHARE * self.d2h_bytes_per_s)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Build a profile from `to_dict()` output; names missing and unknown keys."""
        if not isinstance(data, dict):
            raise ValueError(f"a hardware profile must be a JSON object, got "
                             f"{type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING}
        missing = sorted(names - optional - data.keys())
        unknown = sorted(data.keys() - names)
        if missing or unknown:
            raise ValueError(f"hardware profile has missing keys {missing} and unknown keys "
                             f"{unknown}; expected exactly {sorted(names)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, atomically (a reader never sees half a file), through
        a temporary file of this writer's own: the ranks of a launch measuring at once
        (`hardware="auto"`) save to the same cache path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".tmp", delete=False) as f:
            f.write(json.dumps(self.to_dict(), indent=1) + "\n")
        os.chmod(f.name, 0o644)  # as a plain open() would leave it, not mkstemp's 0600
        os.replace(f.name, path)

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"hardware profile {str(path)!r} does not exist; write one with "
                             "`lazytrain profile --hardware auto --save-hardware PATH`") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"hardware profile {str(path)!r} is not valid JSON ({err})") from None
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"hardware profile {str(path)!r}: {err}") from None


_GIB = 1024**3
_PAPER = "LazyTrain paper (arXiv 2608.11919) measurements"
_NVME_PAPER = f"NVMe 2.83 GB/s read / 3.35 GB/s write, one drive: {_PAPER}"
_NVME_DC = ("NVMe 6.8 / 4.0 GB/s, one drive: vendor sheet of a PCIe 4.0 datacenter SSD "
            "(Samsung PM9A3 3.84 TB sequential read/write)")
_PCIE4 = ("PCIe 4.0 x16 24 GB/s each way: typical pinned bandwidthTest result (~75% of the "
          "31.5 GB/s link)")
_HOPPER_ACHIEVED = ("achieved rate 0.32 x peak: back-derived from the paper's H800 27B run "
                    "(219.95 TFLOPS in the 6*params*tokens convention = ~316 TFLOPS once the "
                    "forward re-run, 13 recomputed layers and attention are counted)")
_AMPERE_ACHIEVED = ("achieved rate 0.45 x peak: estimate of an end-to-end transformer layer "
                    "(GEMMs + attention + elementwise) on Ampere/Ada, not the GEMM peak")
_OPTIMIZER = ("host optimizer {rate:.3g} params/s = host DRAM {bw:.1f} GB/s x "
              f"{HOST_MEMORY_EFFICIENCY} (a triad's share of it) x "
              "{fraction} (the 8-bit update's fraction of the triad, its {isa} variant on "
              "this {isa} host: bench/optimizer.py --params-m 200 --threads 2, 2026-12-05, "
              "Zen 5 guest, load 0.4-1.0; docs/benchmarks.md 'The presets' host update "
              f"rate') / {HOST_UPDATE_BYTES_PER_PARAM} bytes a parameter (gradient 4, "
              "master 8, moment codes 4, bf16 compute copy 2)")
_DEVICE_UPDATE = ("GPU update of the residents {rate:.1e} params/s: {eff} x the memory "
                  "bandwidth over the " + str(DEVICE_UPDATE_BYTES_PER_PARAM) + " bytes a "
                  "parameter the 8-bit update's torch path moves (an estimate)")
_DGX_HOST = ("host DRAM 614.4 GB/s: 2 Xeon Platinum 8480C (NVIDIA DGX H100/H200 user guide) "
             "x 8 channels DDR5-4800 (Intel ARK, Xeon Platinum 8480+) x 8 bytes; "
             "Sapphire Rapids runs AVX-512")
_DGX_A100_HOST = ("host DRAM 409.6 GB/s: 2 AMD EPYC 7742 (NVIDIA DGX A100 user guide) x 8 "
                  "channels DDR4-3200 (AMD EPYC 7742 product page) x 8 bytes; Zen 2: "
                  "AVX2, no AVX-512")
_WORKSTATION_DDR4_HOST = ("host DRAM 204.8 GB/s: 8 channels DDR4-3200 (AMD Ryzen Threadripper "
                          "PRO 3000WX product page) x 8 bytes, an assumed workstation (512 GiB "
                          "takes 8 DIMMs); Zen 2: AVX2, no AVX-512")
_WORKSTATION_DDR5_HOST = ("host DRAM 166.4 GB/s: 4 channels DDR5-5200 (AMD Ryzen Threadripper "
                          "7000 product page) x 8 bytes, an assumed workstation; Zen 4 runs "
                          "AVX-512 on 256-bit units, the fraction was measured on Zen 5's "
                          "full-width ones")
_LAYER_OVERHEAD = (f"layer run overhead {GPU_LAYER_FORWARD_OVERHEAD_S * 1e3:.1f} ms forward, "
                   f"{GPU_LAYER_BACKWARD_OVERHEAD_S * 1e3:.1f} ms backward, step overhead "
                   f"{GPU_STEP_OVERHEAD_S * 1e3:.0f} ms: estimates (the first kernel "
                   "launches of each run and the Python around it)")
_PAGEABLE = (f"pageable copies {PAGEABLE_SHARE:.2f} x the pinned rates: MegaTrain's measured "
             "~14 GB/s pageable against ~21 GB/s pinned H2D")
_DEQUANT = ("dequantization {rate:.0f} GB/s moved: {eff} x the {bw:.0f} GB/s memory "
            "bandwidth of the same vendor sheet (a bandwidth-bound estimate of bitsandbytes' "
            "dequantize kernel: packed read + bf16 write)")


_NET_HOPPER = ("network 8 x 400 Gb/s (3.2 Tb/s a node): a DGX H100/H200's ConnectX-7 "
               "compute fabric; AWS p5/p5en EFA 3200 Gbps")
_NET_AMPERE = "network 8 x 200 Gb/s (1.6 Tb/s a node): a DGX A100's HDR InfiniBand"
_NET_WORKSTATION = "network one 100 Gb/s NIC: assumed (workstation)"


def _preset(*, name: str, gpu_name: str, gpu_gib: float, cpu_gib: float, nvme_tb: float,
            peak_tflops: float, efficiency: float, h2d_gbps: float, d2h_gbps: float,
            nvme_read_gbps: float, nvme_write_gbps: float, memory_gbps: float,
            host_memory_gbps: float, host_isa: str, network_gbps: float,
            source: list[str]) -> HardwareProfile:
    """A preset in the units vendor sheets use (GiB, TB, TFLOPS, GB/s; the network in
    Gb/s, all NICs of the node together); its host update
    rate follows from its host DRAM bandwidth and its CPU's vector ISA, the one the
    kernel's dispatch would pick there (`host_update_params_per_s`)."""
    device_update = device_update_params_per_s(memory_gbps * 1e9)
    host_update = host_update_params_per_s(host_memory_gbps * 1e9, host_isa)
    return HardwareProfile(
        name=name, gpu_name=gpu_name, gpu_memory_bytes=int(gpu_gib * _GIB),
        cpu_memory_bytes=int(cpu_gib * _GIB), nvme_bytes=int(nvme_tb * 1e12),
        peak_bf16_flops_per_s=peak_tflops * 1e12,
        achieved_flops_per_s=peak_tflops * efficiency * 1e12,
        h2d_bytes_per_s=h2d_gbps * 1e9, d2h_bytes_per_s=d2h_gbps * 1e9,
        nvme_read_bytes_per_s=nvme_read_gbps * 1e9, nvme_write_bytes_per_s=nvme_write_gbps * 1e9,
        cpu_optimizer_params_per_s=host_update,
        dequant_bytes_per_s=DEQUANT_EFFICIENCY * memory_gbps * 1e9,
        gpu_optimizer_params_per_s=device_update,
        host_memory_bytes_per_s=host_memory_gbps * 1e9,
        h2d_pageable_bytes_per_s=PAGEABLE_SHARE * h2d_gbps * 1e9,
        d2h_pageable_bytes_per_s=PAGEABLE_SHARE * d2h_gbps * 1e9,
        internode_bytes_per_s=network_gbps * 1e9 / 8,
        source="; ".join([*source, _PAGEABLE,
                          _OPTIMIZER.format(rate=host_update, bw=host_memory_gbps, isa=host_isa,
                                            fraction=HOST_UPDATE_TRIAD_FRACTION[host_isa]),
                          _DEVICE_UPDATE.format(rate=device_update, eff=DEQUANT_EFFICIENCY),
                          _DEQUANT.format(rate=DEQUANT_EFFICIENCY * memory_gbps,
                                          eff=DEQUANT_EFFICIENCY, bw=memory_gbps),
                          _LAYER_OVERHEAD]))


#: Known machines; GPU memory is what `torch.cuda.get_device_properties().total_memory`
#: reports for the card (a little under the marketing number), host sizes are assumptions.
HARDWARE_PRESETS: dict[str, HardwareProfile] = {p.name: p for p in (
    _preset(name="h800", gpu_name="NVIDIA H800 80GB", gpu_gib=79.1, cpu_gib=1024, nvme_tb=3.84,
            peak_tflops=989.4, efficiency=0.32, h2d_gbps=12.0, d2h_gbps=12.0,
            nvme_read_gbps=2.83, nvme_write_gbps=3.35, memory_gbps=3350, host_memory_gbps=614.4,
            host_isa="avx512", network_gbps=3200,
            source=["peak 989.4 dense bf16 TFLOPS: NVIDIA H100/H800 SXM5 datasheet",
                    _HOPPER_ACHIEVED, f"PCIe Gen5 12 GB/s each way: {_PAPER}", _NVME_PAPER,
                    "host 1 TiB: assumed (8-GPU server class)", _DGX_HOST,
                    _NET_HOPPER]),
    _preset(name="h200", gpu_name="NVIDIA H200 141GB", gpu_gib=139.8, cpu_gib=1024,
            nvme_tb=3.84, peak_tflops=989.4, efficiency=0.32, h2d_gbps=50.0, d2h_gbps=50.0,
            nvme_read_gbps=6.8, nvme_write_gbps=4.0, memory_gbps=4800, host_memory_gbps=614.4,
            host_isa="avx512", network_gbps=3200,
            source=["peak 989.4 dense bf16 TFLOPS: NVIDIA H200 SXM datasheet",
                    _HOPPER_ACHIEVED, "PCIe 5.0 x16 50 GB/s each way: typical pinned result "
                    "(~80% of the 63 GB/s link)", _NVME_DC, "host 1 TiB: assumed", _DGX_HOST,
                    _NET_HOPPER]),
    _preset(name="a100-80g", gpu_name="NVIDIA A100 80GB", gpu_gib=79.2, cpu_gib=1024,
            nvme_tb=3.84, peak_tflops=312.0, efficiency=0.45, h2d_gbps=24.0, d2h_gbps=24.0,
            nvme_read_gbps=6.8, nvme_write_gbps=4.0, memory_gbps=2039, host_memory_gbps=409.6,
            host_isa="avx2", network_gbps=1600,
            source=["peak 312 dense bf16 TFLOPS: NVIDIA A100 datasheet", _AMPERE_ACHIEVED,
                    _PCIE4, _NVME_DC, "host 1 TiB: assumed", _DGX_A100_HOST,
                    _NET_AMPERE]),
    _preset(name="a100-40g", gpu_name="NVIDIA A100 40GB", gpu_gib=39.4, cpu_gib=512,
            nvme_tb=3.84, peak_tflops=312.0, efficiency=0.45, h2d_gbps=24.0, d2h_gbps=24.0,
            nvme_read_gbps=6.8, nvme_write_gbps=4.0, memory_gbps=1555, host_memory_gbps=409.6,
            host_isa="avx2", network_gbps=1600,
            source=["peak 312 dense bf16 TFLOPS: NVIDIA A100 datasheet", _AMPERE_ACHIEVED,
                    _PCIE4, _NVME_DC, "host 512 GiB: assumed", _DGX_A100_HOST,
                    _NET_AMPERE]),
    _preset(name="rtx3090", gpu_name="NVIDIA GeForce RTX 3090", gpu_gib=23.7, cpu_gib=512,
            nvme_tb=2.0, peak_tflops=71.0, efficiency=0.45, h2d_gbps=24.0, d2h_gbps=24.0,
            nvme_read_gbps=2.83, nvme_write_gbps=3.35, memory_gbps=936, host_memory_gbps=204.8,
            host_isa="avx2", network_gbps=100,
            source=["peak 71 dense bf16 TFLOPS (fp32 accumulate): NVIDIA Ampere GA102 "
                    "whitepaper", _AMPERE_ACHIEVED, _PCIE4,
                    f"{_NVME_PAPER} (the paper's second testbed)",
                    "host 512 GiB: assumed, enough for the paper's 27B run on this card",
                    _WORKSTATION_DDR4_HOST,
                    _NET_WORKSTATION]),
    _preset(name="rtx4090", gpu_name="NVIDIA GeForce RTX 4090", gpu_gib=23.6, cpu_gib=256,
            nvme_tb=2.0, peak_tflops=165.2, efficiency=0.45, h2d_gbps=24.0, d2h_gbps=24.0,
            nvme_read_gbps=7.45, nvme_write_gbps=6.9, memory_gbps=1008, host_memory_gbps=166.4,
            host_isa="avx512", network_gbps=100,
            source=["peak 165.2 dense bf16 TFLOPS (fp32 accumulate): NVIDIA Ada AD102 "
                    "whitepaper", _AMPERE_ACHIEVED, _PCIE4,
                    "NVMe 7.45 / 6.9 GB/s, one drive: vendor sheet of a PCIe 4.0 consumer SSD "
                    "(Samsung 990 Pro 2 TB)", "host 256 GiB: assumed (workstation)",
                    _WORKSTATION_DDR5_HOST,
                    _NET_WORKSTATION]),
)}


def preset_for_gpu(gpu_name: str) -> HardwareProfile | None:
    """The preset of the GPU model `gpu_name` names (as CUDA reports it: "NVIDIA H200",
    "NVIDIA GeForce RTX 4090"; an H100 takes the H800's, the same silicon), else None."""
    compact = gpu_name.lower().replace(" ", "")
    for preset in HARDWARE_PRESETS.values():
        if preset.name.split("-")[0] in compact:  # "a100-80g" -> "a100"
            return preset
    return HARDWARE_PRESETS["h800"] if "h100" in compact else None
