"""Checkpoints beside training: no saves, blocking saves and asynchronous saves, side by
side in one process (issue 33).

A Qwen2-style model of ~260M parameters (hidden 1024, 20 layers, vocab 32000, tied)
trained through the Accelerate plugin on the CPU (`megatrain` plan, hybrid 8-bit AdamW,
batch 1 x seq 64), `--steps` steps per variant,
`save_state` every `--every` steps in the two saving variants (`checkpoint_mode="sync"`
and `"async"`). Prints, for each saving variant, its mean step over the mean step without
saves (from one step's start to the next, the first step left out; the async save's
writing is inside the steps that follow it, the last one's wait in the last step) and the
same for the process's CPU seconds (every thread: what other processes' load changes
least), the host peak (RSS, sampled every 5 ms)
over the peak without saves, and the save's write rate against the disk's sequential
write rate (a file of `--probe-gb` GB written past the page cache as the saves write, and
fsynced, in the same run, same folder; the buffered rate is printed beside it).

    python bench/checkpoint.py [--steps 7] [--every 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.checkpoints.direct import DirectFile, Staging
from lazytrain_accel.optim import HybridAdamW8bit

#: The run order; no saves first and last, their mean the baseline (a shared machine's
#: load drifts over the minutes a variant takes).
VARIANTS = ("none", "sync", "async", "none")


def _model() -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=32000, hidden_size=1024,
                                      intermediate_size=2816, num_hidden_layers=20,
                                      num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


class PeakRss:
    """The process's largest resident set while `with` runs, sampled every 5 ms."""

    def __enter__(self) -> PeakRss:
        self.peak_bytes, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        page_bytes = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.005):
            with open("/proc/self/statm") as f:
                self.peak_bytes = max(self.peak_bytes, int(f.read().split()[1]) * page_bytes)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(variant: str, steps: int, every: int, tmp: Path) -> dict[str, float]:
    """One variant: mean step, host peak, and the saves' bytes and seconds."""
    ids = torch.randint(0, 32000, (steps, 1, 64), generator=torch.Generator().manual_seed(0))
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800", cache_dir=str(tmp / "c"),
                             nvme_dir=str(tmp / "n"), overlap_step=True,  # as on a GPU
                             checkpoint_mode="sync" if variant == "sync" else "async")
    acc = Accelerator(cpu=True, plugin=plugin)
    model = _model()
    model, opt = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=1e-4))
    starts, cpu_starts, saves = [], [], []
    with PeakRss() as rss:
        for step in range(steps):
            starts.append(time.perf_counter())
            cpu_starts.append(time.process_time())
            batch = ids[step]
            acc.backward(model(input_ids=batch, labels=batch).loss)
            opt.step()
            opt.zero_grad()
            if variant != "none" and step % every == every - 1:
                saves.append(_save(acc, tmp / f"ckpt-{variant}"))
        acc.end_training()  # waits for the last async save
        starts.append(time.perf_counter())
        cpu_starts.append(time.process_time())
    durations = [b - a for a, b in itertools.pairwise(starts)][1:]
    cpu_durations = [b - a for a, b in itertools.pairwise(cpu_starts)][1:]
    written = [(s.written_bytes, s.duration_s) for s in saves if not isinstance(s, tuple)]
    written += [s for s in saves if isinstance(s, tuple)]
    shutil.rmtree(tmp / f"ckpt-{variant}", ignore_errors=True)
    return {"step_s": statistics.mean(durations), "peak_bytes": rss.peak_bytes,
            "step_cpu_s": statistics.mean(cpu_durations),
            "saved_bytes": sum(b for b, _ in written), "save_s": sum(s for _, s in written),
            "params": sum(p.numel() for p in model.parameters())}


def _save(acc: Accelerator, directory: Path) -> object:
    """A blocking save: (bytes, seconds); an async one: its PendingSave."""
    acc.lazytrain_wait_for_checkpoint()  # a pending save is waited for by save_state too
    start = time.perf_counter()
    acc.save_state(str(directory))
    pending = acc.lazytrain.pending_save
    if pending is not None:
        return pending
    size = sum(f.stat().st_size for f in directory.iterdir())
    return size, time.perf_counter() - start


def disk_write_bytes_per_s(folder: Path, size_gb: float, *, direct: bool) -> float:
    """Sequential write with fsync of a `size_gb` file in `folder`, 16 MiB at a time:
    past the page cache as the saves write (`direct`, checkpoints/direct.py), or
    buffered."""
    chunk = os.urandom(16 << 20)
    count = max(1, int(size_gb * 1e9) // len(chunk))
    path = folder / "disk-probe.bin"
    start = time.perf_counter()
    if direct:
        with DirectFile(path, Staging()) as f:
            for _ in range(count):
                f.write(chunk)
            f.finish()
            f.fsync()
    else:
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return count * len(chunk) / seconds


def _release() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the next variant starts from a trimmed heap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--probe-gb", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(dir=args.dir))
    runs = []
    for variant in VARIANTS:
        runs.append((variant, run(variant, args.steps, args.every, tmp)))
        _release()
    disk = disk_write_bytes_per_s(tmp, args.probe_gb, direct=True)
    buffered = disk_write_bytes_per_s(tmp, args.probe_gb, direct=False)
    shutil.rmtree(tmp, ignore_errors=True)
    results = dict(runs)
    nones = [r for v, r in runs if v == "none"]
    base = {k: statistics.mean(r[k] for r in nones) for k in nones[0]}
    print("no saves, each run: mean step " + ", ".join(f"{r['step_s']:.2f} s" for r in nones))
    print(f"model: {base['params'] / 1e6:.0f}M parameters; load average "
          f"{os.getloadavg()[0]:.2f}; disk sequential write {disk / 1e6:.0f} MB/s past the "
          f"page cache ({buffered / 1e6:.0f} MB/s buffered)")
    print(f"no saves: mean step {base['step_s']:.2f} s ({base['step_cpu_s']:.2f} CPU s), "
          f"host peak {base['peak_bytes'] / 1e9:.2f} GB")
    for variant in ("sync", "async"):
        r = results[variant]
        rate = r["saved_bytes"] / max(r["save_s"], 1e-9)
        print(f"{variant:5s} saves: mean step ratio {r['step_s'] / base['step_s']:.3f}x (CPU "
              f"{r['step_cpu_s'] / base['step_cpu_s']:.3f}x), host "
              f"peak ratio {r['peak_bytes'] / base['peak_bytes']:.3f}x, save write "
              f"{rate / 1e6:.0f} MB/s = {rate / disk:.2f}x the disk's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
