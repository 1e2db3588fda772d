"""A checkpoint of state homed on NVMe: copied file to file against read through DRAM,
side by side in one process (issue 44 item 4).

A source file of `--gb` GB stands for the layers' state files (`<nvme>/state/optim-j.bin`);
a checkpoint file is written from it the two ways the async writer could, alternated for
`--rounds` rounds, each fsynced: `copy`: `DirectFile.copy_from` in 16 MiB ranges (what
`PendingSave` does for a tensor whose file bytes are the checkpoint's:
`copy_file_range(2)`); `read`: each `--layer-mb` MB "layer" read into a tensor of its own,
then written through the staging buffer (`DirectFile.write`, the writer's path before, and
still where a weight is cast to the export dtype). Prints per way the median wall seconds
and the process's CPU seconds (user + system, every thread), and the ratios copy / read;
then the peak RSS growth of each way (copy measured first: the peak only grows). The page
cache is whatever the machine's: the source was just written, so both ways may read it
from there alike.

    python bench/checkpoint_copy.py [--gb 1] [--layer-mb 256] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lazytrain_accel.checkpoints.direct import DirectFile, Staging

CHUNK_BYTES = 16 << 20


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _copy(source: int, total: int, target: Path, staging: Staging, layer: int) -> None:
    with DirectFile(target, staging) as f:
        for start in range(0, total, CHUNK_BYTES):
            f.copy_from(source, start, min(CHUNK_BYTES, total - start))
        f.finish()
        f.fsync()


def _read(source: int, total: int, target: Path, staging: Staging, layer: int) -> None:
    with DirectFile(target, staging) as f:
        for start in range(0, total, layer):
            values = torch.empty(min(layer, total - start), dtype=torch.uint8)
            os.preadv(source, [values.numpy()], start)
            data = memoryview(values.numpy())
            for at in range(0, len(data), CHUNK_BYTES):
                f.write(data[at:at + CHUNK_BYTES])
            del values, data
        f.finish()
        f.fsync()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--layer-mb", type=float, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    total, layer = int(args.gb * 1e9), int(args.layer_mb * 1e6)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        with open(folder / "state.bin", "wb") as f:
            for start in range(0, total, CHUNK_BYTES):
                f.write(os.urandom(min(CHUNK_BYTES, total - start)))
            os.fsync(f.fileno())
        source = os.open(folder / "state.bin", os.O_RDONLY)
        staging = Staging()
        ways = {"copy": _copy, "read": _read}
        wall: dict[str, list[float]] = {w: [] for w in ways}
        cpu: dict[str, list[float]] = {w: [] for w in ways}
        growth: dict[str, int] = {}
        try:
            for _ in range(args.rounds):
                for way, run in ways.items():
                    before_rss, start_cpu, start_s = _peak_rss_bytes(), _cpu_s(), \
                        time.perf_counter()
                    run(source, total, folder / f"{way}.safetensors", staging, layer)
                    wall[way].append(time.perf_counter() - start_s)
                    cpu[way].append(_cpu_s() - start_cpu)
                    growth[way] = max(growth.get(way, 0), _peak_rss_bytes() - before_rss)
                    if way == "copy":
                        assert (folder / "copy.safetensors").stat().st_size == total
                    (folder / f"{way}.safetensors").unlink()
        finally:
            os.close(source)
    print(f"{args.gb:g} GB of state, {args.rounds} rounds alternated, layers of "
          f"{args.layer_mb:g} MB for the read way\n")
    print("| way | wall s (median) | GB/s | CPU s (median) | peak RSS growth MB |")
    print("|---|---|---|---|---|")
    for way in ways:
        w, c = statistics.median(wall[way]), statistics.median(cpu[way])
        print(f"| {way} | {w:.2f} | {total / w / 1e9:.2f} | {c:.2f} | {growth[way] / 1e6:.0f} |")
    median = {w: (statistics.median(wall[w]), statistics.median(cpu[w])) for w in ways}
    print(f"\ncopy / read: wall {median['copy'][0] / median['read'][0]:.2f}x, "
          f"CPU {median['copy'][1] / median['read'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
