"""Demo training steps at different torch thread counts, alternating in one process.

Builds the demo's model, data and plugin exactly as `lazytrain demo` does, then times
optimizer steps with `torch.set_num_threads(k)` for each k in turn, several rounds, and
prints each k's median step time as a ratio to the all-cores setting. Run it quiet and
beside a competing process (e.g. `python -c "while True: pass" &`) to see what the
rule of lazytrain_accel/threads.py buys. Usage: python bench/threads.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from lazytrain_accel.demo.model import load_model_and_tokenizer
from lazytrain_accel.demo.run import (
    DemoSettings,
    _accelerator,
    _load_records,
    _make_loader,
    _schedule,
)
from lazytrain_accel.demo.train import _optimizer_step
from lazytrain_accel.threads import usable_cores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per k per round")
    args = parser.parse_args()
    os.environ.setdefault("LAZYTRAIN_CACHE_DIR", tempfile.mkdtemp())
    settings = DemoSettings(hardware="h800", plan="lazytrain")
    train_records, _ = _load_records(settings)
    model, tokenizer = load_model_and_tokenizer(
        None, [r["query"] + "\n" + r["response"] for r in train_records], seed=0)
    loader = _make_loader(tokenizer, train_records, settings)
    accelerator = _accelerator(settings, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = _schedule(optimizer, 10**6)
    batches = iter(loader)
    cores = usable_cores()
    counts = sorted({1, max(1, cores // 2), cores})
    times_s: dict[int, list[float]] = {k: [] for k in counts}
    for _ in range(args.rounds):
        for k in counts:
            torch.set_num_threads(k)
            _optimizer_step(accelerator, model, optimizer, scheduler, next(batches),
                            max_grad_norm=1.0)  # warm-up at this count
            for _ in range(args.steps):
                start = time.perf_counter()
                _optimizer_step(accelerator, model, optimizer, scheduler, next(batches),
                                max_grad_norm=1.0)
                times_s[k].append(time.perf_counter() - start)
    base = statistics.median(times_s[cores])
    print(f"usable cores {cores}, load average {os.getloadavg()[0]:.1f}")
    for k in counts:
        print(f"threads {k}: median step {statistics.median(times_s[k]):.3f} s, "
              f"{base / statistics.median(times_s[k]):.2f}x the speed of {cores} threads")


if __name__ == "__main__":
    main()
