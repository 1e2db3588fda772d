"""The host update against the memory bandwidth (issues 9, 32). Prints ratios; never run by
pytest.

    python bench/optimizer.py [--params-m 64] [--rounds 3] [--threads 1,2] [--code-choice]

One process; at each thread count the contenders alternate round by round (medians), so
each sees the same machine load:
- HybridAdamW8bit through each kernel variant this CPU runs (AVX-512, AVX2, ...: built with
  the instruction set forced), without and with clipping, without and with the bf16
  compute-copy write;
- torch AdamW, fused, fp32, without and with `clip_grad_norm_`;
- DeepSpeed's DeepSpeedCPUAdam (fp32 states, AdamW mode, the same hyperparameters, with
  and without `clip_grad_norm_`) when it builds here (`pip install .[bench]`; its JIT needs
  ninja and a compiler, ~100 s per build on a 2-core Zen 5): its builder's own SIMD width
  (AVX-512 where the CPU has it), and on an AVX-512 CPU its AVX2 build too (`avx256`), so
  the AVX2 builds compare on one machine; otherwise the reason is printed;
- a STREAM triad in C++ (bench/stream_triad.cpp, streaming stores), the ceiling.
Each prints achieved GB/s (the bytes it must move per parameter, `BYTES_PER_PARAM`), its
fraction of the triad's, params/s and its time relative to fused AdamW's. `--code-choice`
adds the 8-bit code comparison of issue 9 (bitsandbytes' dynamic map vs ours).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lazytrain_accel.optim import HybridAdamW8bit, native

GB = 1e9
#: Bytes each contender must move per parameter: grad 4 read; fp32 master 4 + 4; ours two
#: 1-byte codes read and written (4), fp32 AdamW two fp32 moments (16); clipping reads the
#: gradient once more for the norm (+4); the compute copy writes bf16 (+2); the triad
#: reads two fp32 and writes one (12, streaming stores). DeepSpeed's fp32 CPUAdam moves what
#: fused AdamW does (28). These are the bytes each must move: torch's `clip_grad_norm_` (the
#: "+clip" rows of fused AdamW and DeepSpeed) also rewrites the gradients in place, 8 more
#: bytes than counted (40 in all), where ours applies the coefficient inside the update.
BYTES_PER_PARAM = {"ours": 16, "ours+bf16": 18, "ours+clip": 20, "ours+clip+bf16": 22,
                   "adamw_fused": 28, "adamw_fused+clip": 32, "deepspeed_cpuadam": 28,
                   "deepspeed_cpuadam+clip": 32, "triad": 12}
_VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                 "avx512_bf16", "asimd", "sve", "sve2")


def cpu_description() -> str:
    """The CPU's model and vector features, so each run states where it ran."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "CPU part"):
                model = line.partition(":")[2].strip()
                break
    flags = sorted(f for f in native.cpu_flags() if f in _VECTOR_FLAGS)
    return f"{model} ({platform.machine()}); vector flags: {' '.join(flags) or 'none found'}"


def make_params(total_m: int) -> list[torch.nn.Parameter]:
    """Llama-style layer shapes (hidden 1024, MLP 2816): q, k, v, o, gate, up, down."""
    shapes = [(1024, 1024)] * 4 + [(2816, 1024)] * 2 + [(1024, 2816)]
    per_layer = sum(a * b for a, b in shapes)
    params = []
    for _ in range(max(1, round(total_m * 1e6 / per_layer))):
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape) * 0.02)
            p.grad = torch.randn(shape) * 1e-3
            params.append(p)
    return params


@contextlib.contextmanager
def kernel_variant(name: str) -> Iterator[None]:
    """Optimizers built inside use the kernel of variant `name`."""
    module = native.load_kernel(name)
    if module is None:
        raise RuntimeError(f"the {name} kernel variant did not build (see the warning)")
    saved = native.load_kernel
    native.load_kernel = lambda: module  # type: ignore[assignment]
    try:
        yield
    finally:
        native.load_kernel = saved


def ours(params: list[torch.nn.Parameter], *, clip: bool,
         outs: list[torch.Tensor] | None) -> Callable[[], None]:
    """HybridAdamW8bit's step as the engine runs it; `outs` receive the bf16 copy."""
    opt = HybridAdamW8bit(params, lr=1e-5, max_grad_norm=1e9 if clip else None)

    def step() -> None:
        if opt.begin_step():
            opt.step_params(params, out_bf16=outs)
            opt.end_step()
    return step


def with_clip(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
              clip: bool) -> Callable[[], None]:
    def step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True)
        opt.step()
    return step


#: DeepSpeed's builds measured: the SIMD width its builder picks for this CPU, then the
#: AVX2 build (`-D__AVX256__`, `-march=x86-64-v3`) an AVX2-only CPU gets, on x86 CPUs that
#: run it. Named by DeepSpeed's `simd_width` macro.
_DEEPSPEED_AVX256 = ("-D__AVX256__", "-march=x86-64-v3")


def deepspeed_builders() -> dict[str, Any] | str:
    """DeepSpeed's CPUAdam op builders by SIMD label ("avx512", "avx256", ...), or why
    DeepSpeed is not here."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as error:  # not installed, or its import fails on this machine
        return _reason(error)
    native_simd = CPUAdamBuilder().simd_width()
    builders: dict[str, Any] = {native_simd.strip("-D_").lower(): CPUAdamBuilder()}
    if native_simd != _DEEPSPEED_AVX256[0] and {"avx2", "fma"} <= native.cpu_flags():

        class Avx256Builder(CPUAdamBuilder):
            """DeepSpeed's CPUAdam built with AVX2 intrinsics and no AVX-512 instructions,
            under a name of its own (its own JIT cache entry)."""

            def __init__(self) -> None:
                super(CPUAdamBuilder, self).__init__(name="cpu_adam_avx256")

            def simd_width(self) -> str:
                return _DEEPSPEED_AVX256[0]

            def cpu_arch(self) -> str:
                return _DEEPSPEED_AVX256[1]

        builders["avx256"] = Avx256Builder()
    return builders


def deepspeed_adam(params: list[torch.nn.Parameter], builder: Any
                   ) -> torch.optim.Optimizer | str:
    """DeepSpeed's CPUAdam, fp32 states, AdamW mode, our hyperparameters, its op built by
    `builder` (JIT, timed), or why it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam, cpu_adam

        start_s = time.perf_counter()
        builder.load()  # cached per name: the constructor's load() finds this op
        print(f"DeepSpeed {builder.name} loaded (built or found in the JIT cache) in "
              f"{time.perf_counter() - start_s:.0f} s")
        saved = cpu_adam.CPUAdamBuilder
        cpu_adam.CPUAdamBuilder = lambda: builder  # the constructor loads this build
        try:
            return DeepSpeedCPUAdam(params, lr=1e-5, weight_decay=1e-2, adamw_mode=True,
                                    fp32_optimizer_states=True)
        finally:
            cpu_adam.CPUAdamBuilder = saved
    except Exception as error:  # JIT build or CPU-feature failures alike
        return _reason(error)


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def build_triad(numel: int) -> Callable[[], None]:
    """The STREAM triad of bench/stream_triad.cpp over `numel` floats (a multiple of 4096)
    at torch's thread count."""
    out = Path(tempfile.mkdtemp()) / "stream_triad.so"
    source = Path(__file__).with_name("stream_triad.cpp")
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                    str(source), "-o", str(out)], check=True)
    library = ctypes.CDLL(str(out))
    library.triad.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float,
                                                      ctypes.c_int, ctypes.c_int]
    a, b, c = torch.zeros(numel), torch.randn(numel), torch.randn(numel)  # pages touched

    def step() -> None:
        library.triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), numel, 3.0,
                      torch.get_num_threads(), 1)
    return step


def contenders(params: list[torch.nn.Parameter], triad_numel: int
               ) -> dict[str, Callable[[], None]]:
    """Every update of the comparison, by name (ours once per kernel variant)."""
    steps: dict[str, Callable[[], None]] = {}
    outs = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]  # shared: less RAM
    for variant in (v.name for v in native.runnable_variants()):
        if variant == "portable" and len(steps) > 0:
            continue  # the vector variants are the ones a user gets
        with kernel_variant(variant):
            for clip in (False, True):
                for bf16 in (False, True):
                    name = "ours" + "+clip" * clip + "+bf16" * bf16
                    steps[f"{name}[{variant}]"] = ours(params, clip=clip,
                                                       outs=outs if bf16 else None)
    fused = torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-2, fused=True)
    for clip in (False, True):
        steps["adamw_fused" + "+clip" * clip] = with_clip(params, fused, clip)
    builders = deepspeed_builders()
    if isinstance(builders, str):
        print(f"DeepSpeedCPUAdam not measured: {builders}")
        builders = {}
    for simd, builder in builders.items():
        deepspeed = deepspeed_adam(params, builder)
        if isinstance(deepspeed, str):
            print(f"DeepSpeedCPUAdam[{simd}] not measured: {deepspeed}")
            continue
        for clip in (False, True):
            steps[f"deepspeed_cpuadam{'+clip' * clip}[{simd}]"] = with_clip(params, deepspeed,
                                                                             clip)
    if triad_numel > 0:
        steps["triad"] = build_triad(triad_numel)
    return steps


def bytes_per_param(name: str) -> int:
    return BYTES_PER_PARAM[name.split("[")[0]]


def measure(steps: dict[str, Callable[[], None]], rounds: int
            ) -> dict[str, tuple[float, float]]:
    """Median (wall seconds, process CPU seconds) of each step, the steps alternating round
    by round. On a shared machine the CPU seconds are the steadier figure: a thread
    descheduled by another job stretches the wall time, not the CPU time."""
    for step in steps.values():
        step()  # state allocated, pages touched, outside the timing
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
            for name, t in times.items()}


def report(step_s: dict[str, tuple[float, float]], numel: int, triad_numel: int,
           threads: int) -> None:
    triad = bytes_per_param("triad") * triad_numel / step_s["triad"][0]
    fused_s, fused_cpu_s = step_s["adamw_fused"]
    print(f"\n{threads} thread(s), {numel / 1e6:.1f}M parameters; triad {triad / GB:.1f} GB/s")
    print(f"{'update':32s} {'step s':>7s} {'vs fused':>8s} {'cpu s':>7s} {'vs fused':>8s} "
          f"{'GB/s':>5s} {'of triad':>8s} {'Mparams/s':>9s}")
    for name, (seconds, cpu_s) in step_s.items():
        if name == "triad":
            continue
        achieved = bytes_per_param(name) * numel / seconds
        print(f"{name:32s} {seconds:7.4f} {seconds / fused_s:7.2f}x {cpu_s:7.3f} "
              f"{cpu_s / fused_cpu_s:7.2f}x {achieved / GB:5.1f} {achieved / triad:8.0%} "
              f"{numel / seconds / 1e6:9.0f}")


def in_cache_ns_per_param(reps: int) -> None:
    """Each update's compute cost: 1 thread, 4 tensors of 256K parameters (state and all
    in a 32 MiB L3; smaller steps would time Python's per-step overhead), best of `reps`
    steps: what a step costs when nothing else runs on the core, steady however loaded
    the machine is, unlike the DRAM-bound figures above."""
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(262144) * 0.02) for _ in range(4)]
    for p in params:
        p.grad = torch.randn(262144) * 1e-3
    steps = contenders(params, triad_numel=0)
    for step in steps.values():
        step()
    best_s = dict.fromkeys(steps, float("inf"))
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best_s[name] = min(best_s[name], time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    print(f"\nin L3, 1 thread, {numel // 1024}K parameters, best of {reps}:")
    for name, seconds in best_s.items():
        print(f"{name:26s} {seconds / numel * 1e9:6.3f} ns/param  "
              f"{seconds / best_s['adamw_fused']:5.2f}x fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=64, help="millions of parameters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--in-cache-reps", type=int, default=300,
                        help="steps of the in-cache compute comparison (0: skip it)")
    parser.add_argument("--code-choice", action="store_true",
                        help="also compare the 8-bit codes (bench/optimizer_codes.py)")
    args = parser.parse_args()
    print(f"cpu: {cpu_description()}")
    print(f"torch {torch.__version__}, kernel variants here: "
          f"{[v.name for v in native.runnable_variants()]}")
    params = make_params(args.params_m)
    numel = sum(p.numel() for p in params)
    # as many floats an array as parameters (at most 2**28, 1 GiB): a step as long as theirs
    triad_numel = min(numel, 2**28) // 4096 * 4096
    steps = contenders(params, triad_numel)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        report(measure(steps, args.rounds), numel, triad_numel, threads)
    if args.in_cache_reps > 0:
        in_cache_ns_per_param(args.in_cache_reps)
    if args.code_choice:
        from optimizer_codes import print_code_choice

        print_code_choice()


if __name__ == "__main__":
    main()
