"""Direct I/O against the page cache, in one process (issue 44): a file of `--size-mib`
MiB in `--dir` written (and fsynced) then read back cold, `--chunk-mib` MiB per request
(default `CHUNK_BYTES`, 4),

* buffered: `write(2)` + fsync, `posix_fadvise(DONTNEED)`, `read(2)`;
* `O_DIRECT` through `storage/direct_io.py`'s `DirectIO` at queue depth 1, 2, 4 and 8
  (its worker threads: one request in flight each), from an ordinary tensor (copied
  through the pool's aligned buffers) and, at the default depth, from a page-aligned one
  (moved without a copy);
* io_uring / libaio, only where a maintained Python package is importable.

Prints each variant's median rate (GB/s) of `--repeats` runs, its ratio to the buffered
baseline, and the process's CPU seconds per GB moved (every thread: what the training
would lose), with the CPU model and whether the file system honoured `O_DIRECT`.

    python bench/direct_io.py [--dir /tmp] [--size-mib 512] [--repeats 3] [--chunk-mib 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lazytrain_accel.storage.direct_io import (
    CHUNK_BYTES,
    DEFAULT_WORKERS,
    AlignedBuffer,
    AlignedBufferPool,
    DirectIO,
    is_direct,
    open_direct,
)

QUEUE_DEPTHS = (1, 2, 4, 8)
#: Maintained Python bindings we would consider, by import name.
ASYNC_PACKAGES = {"io_uring": "liburing", "libaio": "libaio"}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    return names[0] if names else "unknown"


def direct_honoured(folder: Path) -> bool:
    path = folder / "direct-io-probe"
    fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        return is_direct(fd)
    finally:
        os.close(fd)
        path.unlink()


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def buffered_write(path: Path, data: torch.Tensor, chunk_bytes: int) -> None:
    view = memoryview(data.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for start in range(0, len(view), chunk_bytes):
            os.write(fd, view[start:start + chunk_bytes])
        os.fsync(fd)
    finally:
        os.close(fd)


def buffered_read(path: Path, data: torch.Tensor, chunk_bytes: int) -> None:
    view = memoryview(data.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, len(view), chunk_bytes):
            os.readv(fd, [view[start:start + chunk_bytes]])
    finally:
        os.close(fd)


def timed(fn: Callable[[], object], size_bytes: int, repeats: int) -> tuple[float, float]:
    """(median GB/s, median CPU s per GB) of `repeats` runs of `fn`."""
    rates, cpu = [], []
    for _ in range(repeats):
        wall, used = time.perf_counter(), time.process_time()
        fn()
        wall, used = time.perf_counter() - wall, time.process_time() - used
        rates.append(size_bytes / wall / 1e9)
        cpu.append(used / (size_bytes / 1e9))
    return statistics.median(rates), statistics.median(cpu)


def measure(path: Path, data: torch.Tensor, chunk_bytes: int,
            repeats: int) -> dict[str, tuple[float, float]]:
    """'<variant> write' / '<variant> read' -> (GB/s, CPU s/GB)."""
    size = data.numel()
    rows = {}

    def cold_read(read: Callable[[], object]) -> Callable[[], object]:
        return lambda: (drop_cache(path), read())

    rows["buffered write"] = timed(lambda: buffered_write(path, data, chunk_bytes), size,
                                   repeats)
    rows["buffered read"] = timed(cold_read(lambda: buffered_read(path, data, chunk_bytes)),
                                  size, repeats)
    aligned = AlignedBuffer(size).tensor
    aligned.copy_(data)
    variants = [(f"O_DIRECT qd {n}", n, data) for n in QUEUE_DEPTHS]
    variants.append((f"O_DIRECT qd {DEFAULT_WORKERS}, aligned", DEFAULT_WORKERS, aligned))
    for name, depth, source in variants:
        with DirectIO(depth, pool=AlignedBufferPool(chunk_bytes, depth)) as io:
            rows[f"{name} write"] = timed(
                lambda io=io, s=source: io.write_tensors(path, [s], durable=True).result(),
                size, repeats)
            rows[f"{name} read"] = timed(
                cold_read(lambda io=io, s=source: io.read_tensors(path, [s]).result()),
                size, repeats)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES >> 20,
                        help="bytes per request, every variant alike")
    args = parser.parse_args()
    folder = Path(args.dir)
    size = args.size_mib << 20
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; torch {torch.__version__}")
    print(f"file: {args.size_mib} MiB in {folder}; O_DIRECT honoured: "
          f"{direct_honoured(folder)}; requests of {args.chunk_mib} MiB; "
          f"median of {args.repeats}")
    for kind, package in ASYNC_PACKAGES.items():
        found = importlib.util.find_spec(package) is not None
        print(f"{kind} ({package}): {'installed, not measured' if found else 'not installed'}")
    path = folder / f"direct-io-bench-{os.getpid()}.bin"
    try:
        rows = measure(path, data, args.chunk_mib << 20, args.repeats)
    finally:
        path.unlink(missing_ok=True)
    print(f"{'variant':<34} {'GB/s':>6} {'x buffered':>10} {'CPU s/GB':>9}")
    for name, (rate, cpu) in rows.items():
        base = rows["buffered " + name.rsplit(" ", 1)[1]][0]
        print(f"{name:<34} {rate:6.2f} {rate / base:10.2f} {cpu:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
