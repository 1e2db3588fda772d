"""`GenerationWords`: the node store's per-group update generations, read and written only
with acquire/release atomics (`csrc/generation_words.cpp`, loaded with ctypes).

An owner raises a group's generation after writing its masters; the other ranks poll it,
then read the group. Only a release store and acquire loads keep a weakly ordered CPU
(aarch64) from showing generation g with the masters of g - 1; Python has no such store,
so the words are written only through the helper and the Python `view` is read-only.
The helper is built once, on first use, with the system C++ compiler; where it cannot be
(or 8-byte atomics are not lock-free), `unavailable_because` says why and the node store
is refused. Docs: docs/user_guide.md "7. Several GPUs" ("Publication of an update").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

_SOURCE = Path(__file__).parent / "csrc" / "generation_words.cpp"
_CXXFLAGS = ["-O2", "-shared", "-fPIC", "-std=c++17"]
_WORD_BYTES = 8


def _library_path(compiler: str) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    key = "|".join([platform.machine(), compiler, " ".join(_CXXFLAGS)]).encode()
    digest = hashlib.sha1(key + _SOURCE.read_bytes()).hexdigest()[:12]
    return Path(get_default_build_root()) / f"lazytrain_generation_words_{digest}" / "lib.so"


def _build(compiler: str, target: Path) -> None:
    """Compile to a file of this process's own, then rename: ranks building at once each
    write their own and the last rename wins with an identical library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    result = subprocess.run([compiler, *_CXXFLAGS, str(_SOURCE), "-o", str(scratch)],
                            capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        scratch.unlink(missing_ok=True)
        first = (result.stderr.strip().splitlines() or ["no message"])[0]
        raise OSError(f"{compiler} failed on {_SOURCE.name} (exit {result.returncode}): "
                      f"{first}")
    os.replace(scratch, target)


@functools.cache
def _load() -> ctypes.CDLL | str:
    """The helper library, or why it cannot be had here."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return "no C++ compiler (c++, g++ or clang++) on PATH to build the atomics helper"
    target = _library_path(compiler)
    try:
        if not target.is_file():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        return f"the atomics helper could not be built or loaded ({err})"
    library.lazytrain_publish_generation.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.lazytrain_publish_generation.restype = None
    library.lazytrain_read_generation.argtypes = [ctypes.c_void_p]
    library.lazytrain_read_generation.restype = ctypes.c_int64
    if not library.lazytrain_generation_is_lock_free():
        return (f"8-byte atomics are not lock-free on this CPU ({platform.machine()}), so "
                "they cannot order memory shared between processes")
    return library


def unavailable_because() -> str | None:
    """Why the generations cannot be published safely here (then no node store), or None."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


class GenerationWords:
    """`count` int64 generations at `offset_bytes` of the writable shared `buffer` (an
    mmap of the node store; any writable buffer in tests), 8-byte aligned."""

    def __init__(self, buffer: Any, *, offset_bytes: int, count: int) -> None:
        loaded = _load()
        if isinstance(loaded, str):
            raise RuntimeError(f"the node store's generations need the atomics helper: "
                               f"{loaded}; use LazyTrainPlugin(node_store='off')")
        self._library = loaded
        # A ctypes array over the buffer: its address for the helper, and an export that
        # keeps the buffer mapped as long as this object lives.
        self._words = (ctypes.c_int64 * count).from_buffer(buffer, offset_bytes)
        self._address = ctypes.addressof(self._words)
        if self._address % _WORD_BYTES:
            raise ValueError(f"generation words at address {self._address:#x} are not "
                             f"{_WORD_BYTES}-byte aligned (offset {offset_bytes}): atomics "
                             "need aligned words")
        self.count = count
        #: Read-only: Python never stores a generation (a plain store has no release).
        self.view = (memoryview(buffer)[offset_bytes:offset_bytes + _WORD_BYTES * count]
                     .cast("q").toreadonly())

    def _word(self, group: int) -> int:
        if not 0 <= group < self.count:
            raise IndexError(f"parameter group {group} is out of 0..{self.count - 1}")
        return self._address + _WORD_BYTES * group

    def read(self, group: int) -> int:
        """Group `group`'s generation (acquire: its writes before it are visible after)."""
        return self._library.lazytrain_read_generation(self._word(group))

    def publish(self, group: int, generation: int) -> None:
        """Set group `group`'s generation (release: after this thread's writes to it)."""
        self._library.lazytrain_publish_generation(self._word(group), generation)
