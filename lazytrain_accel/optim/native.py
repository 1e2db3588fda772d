"""The native fused kernel: a torch.library op built on first use, or absent.

`load_kernel()` returns the `NativeKernel` of the best instruction-set variant this CPU
runs (`VARIANTS`, picked by the CPU's flags): its op `lazytrain_<variant>::adamw8bit_step`,
registered from C++ in a namespace per variant (variants coexist in one process), runs
without the GIL. None when it cannot be built here: the optimizer then runs
`reference.py`, the same bits, 25-35x slower, and says so once. Each variant is compiled
for a named instruction set, never `-march=native`; its cache name hashes its flags, the
sources, torch and the Python ABI. Design: docs/optimizer.md "Native kernel".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain_accel.optim.codes import EXP_AVG_CODE, EXP_AVG_SQ_CODE

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCE = _CSRC / "adamw8bit.cpp"
#: The torch-free arithmetic the binding includes (and the aarch64 test program builds).
CORE_HEADER = _CSRC / "adamw8bit_core.h"
_HEADERS = (CORE_HEADER, _CSRC / "adamw8bit_avx2.h")
#: The flags of every variant (their own -march come after): no fused multiply-add, so the
#: bits match reference.py; OpenMP for the threads and the `omp simd` loops.
KERNEL_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
_X86 = ("x86_64", "amd64")


@dataclass(kw_only=True, frozen=True)
class KernelVariant:
    """One build of the kernel: the instruction set it is compiled for and the CPU flags
    (as /proc/cpuinfo names them) that instruction set needs."""

    name: str
    machines: tuple[str, ...]  # platform.machine().lower() values it builds on; () = any
    cpu_flags: frozenset[str]
    cflags: tuple[str, ...]


_X86_64_V3_FLAGS = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"})
#: Best first: `runnable_variants()` keeps those this CPU can run, in this order.
VARIANTS = (
    KernelVariant(name="avx512", machines=_X86, cflags=("-march=x86-64-v4", "-mtune=generic"),
                  cpu_flags=_X86_64_V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq",
                                                "avx512vl"}),
    KernelVariant(name="avx2", machines=_X86, cflags=("-march=x86-64-v3", "-mtune=generic"),
                  cpu_flags=_X86_64_V3_FLAGS),
    # NEON is part of armv8-a: every aarch64 CPU runs it (Grace, Graviton, Apple)
    KernelVariant(name="neon", machines=("aarch64", "arm64"), cflags=("-march=armv8-a",),
                  cpu_flags=frozenset()),
    # the compiler's default target for this architecture (x86-64: SSE2)
    KernelVariant(name="portable", machines=(), cflags=(), cpu_flags=frozenset()),
)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    lines = cpuinfo.read_text(errors="replace").splitlines()
    flags = next((line for line in lines if line.split(":")[0].strip() in ("flags", "Features")),
                 "")
    return frozenset(flags.partition(":")[2].split())


def runnable_variants(flags: frozenset[str] | None = None,
                      machine: str | None = None) -> tuple[KernelVariant, ...]:
    """The variants this CPU (or the given flags and machine) can run, best first."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    return tuple(v for v in VARIANTS
                 if (not v.machines or machine in v.machines) and v.cpu_flags <= flags)


def variant_named(name: str) -> KernelVariant:
    """The variant called `name` ("avx512", "avx2", "neon", "portable")."""
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"kernel variant {name!r} does not exist: choose one of "
                     f"{[v.name for v in VARIANTS]}")


def op_namespace(variant: KernelVariant) -> str:
    """The torch.library namespace of `variant`'s ops: `torch.ops.lazytrain_avx2`, ..."""
    return f"lazytrain_{variant.name}"


def _cflags(variant: KernelVariant) -> list[str]:
    return [*KERNEL_CFLAGS, *variant.cflags, f"-DLAZYTRAIN_OPS={op_namespace(variant)}"]


def _build_name(variant: KernelVariant) -> str:
    abi = f"{sys.implementation.cache_tag}|{sysconfig.get_config_var('SOABI')}"
    torch_build = f"{torch.__version__}|{torch.version.git_version}"
    flags = " ".join(_cflags(variant))
    sources = b"".join(path.read_bytes() for path in (_SOURCE, *_HEADERS))
    digest = hashlib.sha1("|".join([platform.machine(), abi, torch_build, flags]).encode()
                          + sources).hexdigest()[:12]
    return f"lazytrain_adamw8bit_{variant.name}_{digest}"


def _build_directory(name: str) -> Path:
    """Where the build of `name` lives (torch's extension root, one folder per build)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


#: A build takes 10-20 s (minutes on a loaded machine): torch's build lock older
#: than this was left by a build that was killed (Ctrl-C, OOM), and torch would wait on it
#: forever, silently.
STALE_BUILD_LOCK_S = 900.0


def clear_stale_build_lock(directory: Path, *, now_s: float | None = None) -> bool:
    """Remove `directory`'s build lock when it is older than `STALE_BUILD_LOCK_S` (said
    in a warning); True if it did. A younger lock is another process's build: wait."""
    lock = directory / "lock"
    try:
        age_s = (time.time() if now_s is None else now_s) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_s < STALE_BUILD_LOCK_S:
        return False
    logger.warning("lazytrain: removing the 8-bit kernel's build lock %s, left %.0f s ago by "
                   "a build that did not finish (interrupted or killed); building again",
                   lock, age_s)
    lock.unlink(missing_ok=True)
    return True


def _expected_constants() -> tuple[int, ...]:
    return (
        EXP_AVG_CODE.shift,
        EXP_AVG_CODE.offset,
        EXP_AVG_CODE.max_code,
        EXP_AVG_SQ_CODE.offset,
        EXP_AVG_SQ_CODE.max_code,
    )


#: How much slower the torch path of reference.py is than the kernel (docs/benchmarks.md,
#: bench/optimizer.py: 25-35x): what the fallback warning says, and what the planner's
#: presets divide the host update rate by when the kernel is absent.
TORCH_PATH_SLOWDOWN = 30.0


@dataclass(kw_only=True, frozen=True)
class NativeKernel:
    """One variant's loaded ops. `adamw8bit_step(param, grad, exp_avg_codes,
    exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax, out_bf16, beta1, beta2, eps,
    decay, step_size, inv_bias_correction2_sqrt, clip_coef, block_size)` updates the first
    six tensors (and `out_bf16`, when not None) in place; the rest is `kernel_info`'s."""

    adamw8bit_step: torch._ops.OpOverload
    instruction_set: str  # what the build's flags compiled it for (a variant's name)
    code_constants: tuple[int, ...]  # the codes' constants, as `_expected_constants()`
    max_block_size: int
    library: str  # the shared library the ops came from


@functools.cache
def load_kernel(variant: str | None = None) -> NativeKernel | None:
    """The kernel's ops for `variant` (default: the best this CPU runs), built once per
    machine; None, with one loud warning, if it cannot be built here."""
    if EXP_AVG_CODE.shift != EXP_AVG_SQ_CODE.shift:
        raise AssertionError("the native kernel assumes both moments share one mantissa width")
    chosen = runnable_variants()[0] if variant is None else variant_named(variant)
    try:
        library = _build(chosen)
    except Exception as error:  # any build failure means: use the torch path
        logger.warning(
            "lazytrain: the native 8-bit AdamW kernel (%s) could not be built (%s: %s). The "
            "optimizer falls back to the pure-torch path: the same bits, but about %.0fx "
            "slower, and the host update will dominate the step. Fix: install a C++ compiler "
            "(apt-get install g++ / xcode-select --install) and ninja (pip install ninja), "
            "then restart; the planner prices the slower rate until then.",
            chosen.name, type(error).__name__,
            str(error).splitlines()[0] if str(error) else "", TORCH_PATH_SLOWDOWN)
        return None
    kernel = _bind(chosen, library)
    if tuple(kernel.code_constants) != _expected_constants():
        raise RuntimeError(
            f"native kernel codes {tuple(kernel.code_constants)} differ from codes.py "
            f"{_expected_constants()}: update csrc/adamw8bit_core.h together with codes.py"
        )
    return kernel


#: op namespace -> the library that registered it in this process. A namespace registers
#: once: loading another build of a loaded variant (its sources changed, another
#: TORCH_EXTENSIONS_DIR) would abort the process in torch's static registration
_LOADED: dict[str, str] = {}
#: the namespaces whose `adamw8bit_step` has its fake kernel (`_fake_adamw8bit_step`)
_FAKE_REGISTERED: set[str] = set()


def _build(variant: KernelVariant) -> str:
    """Build `variant` (unless built) and load it: its ops join torch.ops; the path."""
    from torch.utils.cpp_extension import load

    name = _build_name(variant)
    directory = _build_directory(name)
    library = str(directory / f"{name}.so")
    loaded = _LOADED.get(op_namespace(variant))
    if loaded == library:
        return library  # loaded: calling load() again could rebuild it under a new name
    if loaded is not None:
        raise RuntimeError(f"another build of the {variant.name} kernel is loaded in this "
                           f"process ({loaded}); restart Python to load {library}")
    if not Path(library).is_file():
        logger.warning("lazytrain: building the 8-bit optimizer kernel for %s (first use with "
                       "this source, torch and Python only, ~10-20 s) in %s", variant.name,
                       directory)
    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_build_lock(directory)
    load(name=name, build_directory=str(directory), sources=[str(_SOURCE)],
         extra_cflags=_cflags(variant), extra_ldflags=["-fopenmp"], is_python_module=False,
         verbose=False)
    _LOADED[op_namespace(variant)] = library
    return library


def _bind(variant: KernelVariant, library: str) -> NativeKernel:
    namespace = op_namespace(variant)
    ops = getattr(torch.ops, namespace)
    if namespace not in _FAKE_REGISTERED:
        torch.library.register_fake(f"{namespace}::adamw8bit_step", _fake_adamw8bit_step)
        _FAKE_REGISTERED.add(namespace)
    instruction_set, constants, max_block_size = ops.kernel_info()
    return NativeKernel(adamw8bit_step=ops.adamw8bit_step.default,
                        instruction_set=instruction_set, code_constants=tuple(constants),
                        max_block_size=max_block_size, library=library)


def _fake_adamw8bit_step(
        param: torch.Tensor, grad: torch.Tensor, exp_avg_codes: torch.Tensor,
        exp_avg_absmax: torch.Tensor, exp_avg_sq_codes: torch.Tensor,
        exp_avg_sq_absmax: torch.Tensor, out_bf16: torch.Tensor | None, beta1: float,
        beta2: float, eps: float, decay: float, step_size: float,
        inv_bias_correction2_sqrt: float, clip_coef: float, block_size: int) -> None:
    """The op's fake kernel (torch.compile, fake tensors): it only writes in place, so
    this checks the dtypes and sizes the C++ kernel checks, and returns nothing."""
    n = param.numel()
    blocks = (n + block_size - 1) // block_size
    torch._check(param.dtype == torch.float32 and grad.dtype in (torch.float32, torch.bfloat16),
                 lambda: f"master {param.dtype} / gradient {grad.dtype}: fp32 / fp32 or bf16")
    torch._check(exp_avg_codes.dtype == exp_avg_sq_codes.dtype == torch.uint8,
                 lambda: "codes must be uint8")
    torch._check(grad.numel() == n and exp_avg_codes.numel() == n
                 and exp_avg_sq_codes.numel() == n,
                 lambda: f"gradient/codes sizes differ from the master's {n} elements")
    torch._check(exp_avg_absmax.numel() == blocks and exp_avg_sq_absmax.numel() == blocks,
                 lambda: f"absmax must have one value per block ({blocks})")
    torch._check(out_bf16 is None or (out_bf16.dtype == torch.bfloat16
                                      and out_bf16.numel() == n),
                 lambda: f"out_bf16 must be bf16 with the master's {n} elements")
