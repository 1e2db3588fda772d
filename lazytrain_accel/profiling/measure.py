"""Measure this machine into a `HardwareProfile` (what `hardware="auto"` means).

Each probe is small (a few hundred MB moved, a few matmuls, a few optimizer steps) so
the whole measurement takes seconds; the result is cached as JSON in the cache directory
under a key of the machine (host, GPU, RAM, NVMe directory), so later runs read it back.
On a machine without a GPU the "device" is the CPU: its link is a host memcpy and its
memory is half of host RAM (the other half is the host tier; both share one RAM).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from lazytrain_accel.optim import HybridAdamW8bit, native
from lazytrain_accel.profiling.hardware import MEASURED_NAME_PREFIX, HardwareProfile, preset_for_gpu
from lazytrain_accel.storage.direct_io import DirectIO
from lazytrain_accel.storage.drives import drive_groups, split_dirs

logger = logging.getLogger("lazytrain_accel")

_MIB = 1024**2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time_s(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Fastest of `repeats` timed runs after one warm-up (the warm-up pays lazy init)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _measure_link(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(H2D, D2H) bytes/s with pinned host buffers; on CPU a host memcpy both ways."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d_s = _best_time_s(lambda: dev.copy_(host, non_blocking=True), device)
    d2h_s = _best_time_s(lambda: host.copy_(dev, non_blocking=True), device)
    return nbytes / h2d_s, nbytes / d2h_s


def measure_host_work(device: torch.device, numel: int = 16 * _MIB) -> tuple[float, float]:
    """(stage, fold) bytes/s of the device copy, as the engine's training thread does them
    on an async device (engine/memory/weights.py, grads.py): fp32 masters cast into a
    (pinned on CUDA) staging buffer of the compute dtype; that dtype's staged gradients
    copied into kept fp32 `.grad` storage, then their norms."""
    pin = device.type == "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    master = torch.randn(numel)
    staging = torch.empty(numel, dtype=dtype, pin_memory=pin)
    grad = torch.zeros(numel)
    nbytes = numel * staging.element_size()
    stage_s = _best_time_s(lambda: staging.copy_(master), torch.device("cpu"))
    fold_s = _best_time_s(lambda: torch._foreach_norm([grad.copy_(staging)]),
                          torch.device("cpu"))
    return nbytes / stage_s, nbytes / fold_s


def _drop_page_cache(path: Path) -> None:
    # Where O_DIRECT was refused the read-back would be served from RAM and report
    # memory speed; under O_DIRECT this drops nothing.
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure_nvme(directory: Path, nbytes: int, chunk_bytes: int = 16 * _MIB) -> tuple[
        float, float]:
    """(read, write) bytes/s of a `nbytes` file written (fsync'd) then read cold, as the
    engine's state moves: `O_DIRECT` requests of `direct_io.CHUNK_BYTES`, several in
    flight (`DirectIO`'s default workers), buffered where the file system refuses it.
    The file repeats one random `chunk_bytes` tensor, read back into it."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)
    chunks = [chunk] * max(1, nbytes // chunk_bytes)
    fd, name = tempfile.mkstemp(prefix="lazytrain-probe-", dir=directory)
    os.close(fd)
    path = Path(name)
    try:
        with DirectIO() as io:
            start = time.perf_counter()
            io.write_tensors(path, chunks, durable=True).result()
            write_s = time.perf_counter() - start
            _drop_page_cache(path)
            start = time.perf_counter()
            io.read_tensors(path, chunks).result()
            read_s = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    total = len(chunks) * chunk_bytes
    return total / max(read_s, 1e-9), total / max(write_s, 1e-9)


#: A read beside a write that takes more than this share of the two in turn: the drive
#: shares one bandwidth between them (a full-duplex one takes about half, the longer of
#: the two).
SHARED_DRIVE_SHARE = 0.75


def _measure_nvme_full_duplex(directory: Path, nbytes: int,
                              chunk_bytes: int = 16 * _MIB) -> bool:
    """Whether the drive under `directory` reads and writes at once at their own rates:
    `nbytes` read beside `nbytes` written (`O_DIRECT`, as `_measure_nvme`) against the
    same read and write in turn."""
    chunk = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)
    chunks = [chunk] * max(1, nbytes // chunk_bytes)
    paths = []
    for _ in range(2):
        fd, name = tempfile.mkstemp(prefix="lazytrain-probe-", dir=directory)
        os.close(fd)
        paths.append(Path(name))
    source, target = paths
    try:
        with DirectIO() as io:
            io.write_tensors(source, chunks, durable=True).result()
            _drop_page_cache(source)
            start = time.perf_counter()
            io.read_tensors(source, chunks).result()
            io.write_tensors(target, chunks, durable=True).result()
            in_turn_s = time.perf_counter() - start
            _drop_page_cache(source)
            start = time.perf_counter()
            reading = io.read_tensors(source, chunks)
            io.write_tensors(target, chunks, durable=True).result()
            reading.result()
            at_once_s = time.perf_counter() - start
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return at_once_s < SHARED_DRIVE_SHARE * in_turn_s


def _measure_matmul(device: torch.device) -> float:
    """FLOP/s of a square matmul: bf16 on CUDA, fp32 on CPU (what each computes in)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / _best_time_s(lambda: a @ b, device)


def _measure_optimizer(device: torch.device, num_params: int = 10_000_000) -> float:
    """Params/s of the host update the engine runs: one HybridAdamW8bit step clipped with
    norms gathered beforehand (as the engine's are), writing the bf16 compute copy in the
    same pass when `device` is a GPU (as the overlapped update does for the next step's
    weight stream)."""
    param = torch.nn.Parameter(torch.randn(num_params))
    param.grad = torch.full_like(param, 1e-3)
    out = [torch.empty(num_params, dtype=torch.bfloat16)] if device.type == "cuda" else None
    return num_params / _best_time_s(clipped_step([param], out), torch.device("cpu"))


def _measure_device_optimizer(device: torch.device, host_rate: float,
                              num_params: int = 16_777_216) -> float:
    """Params/s of the residents' update on the GPU (`Plan.resident_update="device"`): one
    HybridAdamW8bit step of a device master, the torch path in whole-block chunks. On a
    CPU the device masters are host tensors updated by the host kernel: `host_rate`."""
    if device.type != "cuda":
        return host_rate
    param = torch.nn.Parameter(torch.randn(num_params, device=device))
    param.grad = torch.full_like(param, 1e-3, dtype=torch.bfloat16)
    return num_params / _best_time_s(clipped_step([param], None), device)


def clipped_step(params: list[torch.nn.Parameter], out: list[torch.Tensor] | None
                 ) -> Callable[[], None]:
    """One clipped HybridAdamW8bit step of `params` (`out`: their bf16 copies, written in
    the same pass), with norms given (the engine's)."""
    optimizer = HybridAdamW8bit(params, lr=1e-3, max_grad_norm=1.0)

    def step() -> None:
        optimizer.set_grad_sq_norms(dict.fromkeys(params, 1.0))  # the engine's: no norm pass
        optimizer.begin_step()
        optimizer.step_params(params, out_bf16=out)
        optimizer.end_step()

    return step


def _measure_dequant(device: torch.device, side: int = 2048) -> tuple[float, str]:
    """Bytes/s an nf4 dequantization moves on `device` (packed data and absmax read, the
    compute-dtype matrix written), with bitsandbytes' own kernel; without bitsandbytes a
    uint8 -> compute-dtype cast copy of as many elements stands in. Returns how, too."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(side, side, device=device, dtype=dtype)
    out_bytes = weight.numel() * weight.element_size()
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        src = torch.ones(side * side, dtype=torch.uint8, device=device)
        seconds = _best_time_s(lambda: weight.view(-1).copy_(src), device)
        return (src.numel() + out_bytes) / seconds, (
            f"a uint8 -> {dtype} cast copy of {side}x{side} (bitsandbytes not installed)")
    packed, state = bnb_functional.quantize_4bit(weight, quant_type="nf4")
    seconds = _best_time_s(lambda: bnb_functional.dequantize_4bit(packed, state), device)
    moved = packed.numel() * packed.element_size() + state.absmax.numel() * 4 + out_bytes
    return moved / seconds, f"bitsandbytes dequantize_4bit of a {side}x{side} nf4 matrix"


def _measure_layer_overheads(device: torch.device) -> tuple[float, float, float]:
    """(forward, backward, step) seconds of the engine's overhead on `device`:
    `lazytrain_accel/layer_probe.py` run as a program (it imports the engine, which imports
    the planner, which imports this package: it cannot be imported here), at this
    process's thread count."""
    command = [sys.executable, "-m", "lazytrain_accel.layer_probe",
               "--device", str(device), "--threads", str(torch.get_num_threads())]
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=True,
                             timeout=600).stdout
        result = json.loads(out.strip().splitlines()[-1])
        return (float(result["forward_s"]), float(result["backward_s"]),
                float(result["step_s"]))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as err:
        raise RuntimeError(f"measuring the engine's per-layer overhead failed ({err}): run "
                           f"`{' '.join(command)}` to see why") from None


def _gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _vendor_peak_flops_per_s(gpu_name: str, measured: float) -> float:
    """The dense bf16 peak of a known GPU (from the presets), else the measured rate."""
    preset = preset_for_gpu(gpu_name)
    return measured if preset is None else preset.peak_bf16_flops_per_s


#: What the probes measure beyond rates (the optimizer's kernel, the residents' device
#: update, the engine's layer overhead); in the cache key, so a cache made by an earlier
#: release's probes is measured again.
_OPTIMIZER_PROBE = "hybrid_adamw8bit+device_residents+layer_overhead+host_work"


def _host_update_kernel() -> str:
    """What runs the host update here: the kernel variant, or the torch path without one."""
    return "torch path" if native.load_kernel() is None else native.runnable_variants()[0].name


def _machine_key(device: torch.device, nvme_dirs: Sequence[Path]) -> str:
    """The cache key: a profile is reused only where it was measured as the run will go,
    including the thread count the run set (`threads.apply_threads`, before this) and the
    host update's kernel (a compiler installed since, or a new CPU, measures again)."""
    key = {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "ram_bytes": psutil.virtual_memory().total, "gpu": _gpu_name(device),
           "nvme_dir": ",".join(str(d.resolve()) for d in nvme_dirs),
           "torch": torch.__version__,
           "optimizer_probe": _OPTIMIZER_PROBE, "threads": torch.get_num_threads(),
           "host_update_kernel": _host_update_kernel()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def local_capacities(device: torch.device | None = None) -> dict[str, int | str]:
    """This process's device and host as a profile's `gpu_name`, `gpu_memory_bytes` and
    `cpu_memory_bytes` (totals, no timing): what each rank of a launch reads of its own
    (`run/shared.py`). On a CPU the "device" and the host tier share the RAM, half each."""
    device = _device_or_default(device)
    ram_bytes = psutil.virtual_memory().total
    if device.type == "cuda":
        gpu_bytes, cpu_bytes = torch.cuda.get_device_properties(device).total_memory, ram_bytes
    else:
        gpu_bytes = cpu_bytes = ram_bytes // 2
    return {"gpu_name": _gpu_name(device), "gpu_memory_bytes": int(gpu_bytes),
            "cpu_memory_bytes": int(cpu_bytes)}


@dataclass(frozen=True)
class _Drives:
    read_bytes_per_s: float  # the drives' sum
    write_bytes_per_s: float
    full_duplex: bool  # every drive
    free_bytes: int  # the drives' sum
    count: int


def _measure_drives(dirs: Sequence[Path], probe_bytes: int) -> _Drives:
    """The drives under `dirs` (one per file system, `drive_groups`) probed at once, as
    the engine's I/O threads per drive run them, their rates summed."""
    drives = [group[0] for group in drive_groups(dirs)]
    if len(drives) < len(dirs):
        logger.warning("lazytrain: nvme_dir names %d directories on %d file systems: "
                       "directories on one drive share its bandwidth (measured once)",
                       len(dirs), len(drives))

    def probe(directory: Path) -> tuple[float, float, bool]:
        read, write = _measure_nvme(directory, probe_bytes)
        return read, write, _measure_nvme_full_duplex(directory, probe_bytes // 2)

    with ThreadPoolExecutor(max_workers=len(drives)) as pool:
        rates = list(pool.map(probe, drives))
    return _Drives(read_bytes_per_s=sum(r[0] for r in rates),
                   write_bytes_per_s=sum(r[1] for r in rates),
                   full_duplex=all(r[2] for r in rates),
                   free_bytes=sum(shutil.disk_usage(d).free for d in drives), count=len(drives))


def _measure(device: torch.device, nvme_dirs: Sequence[Path],
             probe_bytes: int) -> HardwareProfile:
    capacities = local_capacities(device)
    # A host memcpy reaches its steady rate on far less than a PCIe transfer needs.
    link_bytes = probe_bytes if device.type == "cuda" else min(probe_bytes, 64 * _MIB)
    h2d, d2h = _measure_link(device, link_bytes)
    drives = _measure_drives(nvme_dirs, probe_bytes)
    matmul = _measure_matmul(device)
    dequant, dequant_how = _measure_dequant(device)
    host_update = _measure_optimizer(device)
    layer_forward_s, layer_backward_s, step_s = _measure_layer_overheads(device)
    stage, fold = measure_host_work(device)
    gpu_name = str(capacities["gpu_name"])
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return HardwareProfile(
        name=f"{MEASURED_NAME_PREFIX}{platform.node() or 'host'}", gpu_name=gpu_name,
        gpu_memory_bytes=int(capacities["gpu_memory_bytes"]),
        cpu_memory_bytes=int(capacities["cpu_memory_bytes"]),
        nvme_bytes=drives.free_bytes,
        peak_bf16_flops_per_s=_vendor_peak_flops_per_s(gpu_name, matmul),
        achieved_flops_per_s=matmul, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        nvme_read_bytes_per_s=drives.read_bytes_per_s,
        nvme_write_bytes_per_s=drives.write_bytes_per_s,
        nvme_full_duplex=drives.full_duplex, nvme_drives=drives.count,
        cpu_optimizer_params_per_s=host_update,
        gpu_optimizer_params_per_s=_measure_device_optimizer(device, host_update),
        device_runs_async=device.type == "cuda",
        dequant_bytes_per_s=dequant,
        layer_forward_overhead_s=layer_forward_s, layer_backward_overhead_s=layer_backward_s,
        step_overhead_s=step_s, host_stage_bytes_per_s=stage, host_fold_bytes_per_s=fold,
        compute_on_host=device.type != "cuda",
        source=(f"measured by lazytrain_accel on {platform.node()} at {when} with torch "
                f"{torch.__version__}: {link_bytes // _MIB} MiB host<->device copies, a "
                f"{probe_bytes // _MIB} MiB file in each of "
                f"{', '.join(map(str, nvme_dirs))} ({drives.count} drive(s) at once; a read "
                f"beside a write: {'full' if drives.full_duplex else 'shared'} duplex), "
                "a square matmul "
                f"({'bf16' if device.type == 'cuda' else 'fp32'}), a HybridAdamW8bit step of 10M "
                f"params at {torch.get_num_threads()} threads ({_host_update_kernel()} kernel; "
                f"and of 16M on the device), {dequant_how}, tiny decoder layers "
                f"through the engine (layer_probe.py), 16M-element weight staging and "
                "gradient folds"),
    )


def measure_hardware(*, cache_dir: str, nvme_dir: str, refresh: bool = False,
                     device: torch.device | None = None,
                     probe_bytes: int = 256 * _MIB) -> HardwareProfile:
    """Measure this machine (or read the cached measurement) as a `HardwareProfile`.

    `device` defaults to the first CUDA device, else the CPU. `refresh=True` measures
    again and overwrites the cache. `probe_bytes` sizes the copy and NVMe probes. What a
    run calibrates is kept per workload, not here (`workload.py`).
    """
    measured = _cache_path("hardware", cache_dir, nvme_dir, device)
    if measured.is_file() and not refresh:
        try:
            return HardwareProfile.load(measured)
        except ValueError:
            pass  # a cache from another release or a torn write: measure again
    profile = _measure(_device_or_default(device), _nvme_paths(nvme_dir), probe_bytes)
    profile.save(measured)
    return profile


def _device_or_default(device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _nvme_paths(nvme_dir: str) -> list[Path]:
    paths = split_dirs(nvme_dir)
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
    return paths


def _cache_path(kind: str, cache_dir: str, nvme_dir: str,
                device: torch.device | None) -> Path:
    key = _machine_key(_device_or_default(device), _nvme_paths(nvme_dir))
    return Path(cache_dir).expanduser() / f"{kind}-{key}.json"
