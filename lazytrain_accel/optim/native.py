"""The native fused kernel: built on first use with torch.utils.cpp_extension, or absent.

`load_kernel()` returns the compiled module, or None when it cannot be built here (no
compiler, no ninja, an unusual platform); the optimizer then uses the pure-torch path of
`reference.py`, which computes the same bits, only slower. The build is cached under a
name that hashes everything the binary depends on: this CPU's instruction set (it is
compiled with -march=native and must never be reused on an older CPU sharing the cache),
the kernel's source and flags, the torch version and the Python ABI. Two checkouts or
venvs on one machine then keep separate builds instead of overwriting each other's (a
rebuild of 30-50 s on every switch), and a build that exists is loaded, not rebuilt.
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
from pathlib import Path
from types import ModuleType

import torch

from lazytrain_accel.optim.codes import EXP_AVG_CODE, EXP_AVG_SQ_CODE

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "adamw8bit.cpp"
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


def _build_name() -> str:
    cpu = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text(errors="replace").splitlines()
        flags = next((line for line in lines if line.startswith("flags")), "")
    abi = f"{sys.implementation.cache_tag}|{sysconfig.get_config_var('SOABI')}"
    torch_build = f"{torch.__version__}|{torch.version.git_version}"
    digest = hashlib.sha1("|".join([cpu, flags, abi, torch_build, " ".join(_CFLAGS)]).encode()
                          + _SOURCE.read_bytes()).hexdigest()[:12]
    return f"lazytrain_adamw8bit_{digest}"


def _build_directory(name: str) -> Path:
    """Where the build of `name` lives (torch's extension root, one folder per build)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


#: A build takes 30-50 s (a few minutes on a loaded machine): torch's build lock older
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


@functools.cache
def load_kernel() -> ModuleType | None:
    """The compiled kernel module, built once per machine; None if it cannot be built."""
    if EXP_AVG_CODE.shift != EXP_AVG_SQ_CODE.shift:
        raise AssertionError("the native kernel assumes both moments share one mantissa width")
    try:
        from torch.utils.cpp_extension import load

        name = _build_name()
        directory = _build_directory(name)
        if not (directory / f"{name}.so").is_file():
            logger.warning("lazytrain: building the 8-bit optimizer kernel (first use with this "
                           "source, torch and Python only, ~30 s) in %s", directory)
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_build_lock(directory)
        module = load(
            name=name,
            build_directory=str(directory),
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # any build failure means: use the torch path
        logger.warning(
            "lazytrain: native 8-bit AdamW kernel unavailable (%s: %s); using the pure-torch "
            "path, which is exact but several times slower. Install a C++ compiler and "
            "ninja to enable it.",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        return None
    if tuple(module.code_constants) != _expected_constants():
        raise RuntimeError(
            f"native kernel codes {tuple(module.code_constants)} differ from codes.py "
            f"{_expected_constants()}: update csrc/adamw8bit.cpp together with codes.py"
        )
    return module
