"""Peak memory growth and step time of one long sample, 4K to 32K tokens, on this CPU:
sequence-tiled and untiled streaming through the Accelerate plugin, and stock transformers
with gradient checkpointing, each step in a fresh process (`long_context_run.py`); printed
side by side with the ratios to stock, and the planner's predicted growth of the tiled and
untiled steps (`long_context_run.predicted_growth_bytes`) with measured / predicted.

    PYTHONPATH=. python bench/long_context.py [--seqs 4096 8192 16384 32768] [--tile-tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "long_context_run.py"
MODES = ("tiled", "untiled", "stock")
MIB = 2**20


def _run(mode: str, seq: int, tile_tokens: int) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the RSS
    done = subprocess.run([sys.executable, str(RUNNER), "--mode", mode, "--seq", str(seq),
                           "--tile-tokens", str(tile_tokens)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} at {seq} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--tile-tokens", type=int, default=2048)
    args = parser.parse_args()
    print(f"{'tokens':>7} | {'peak growth MiB: tiled':>22} {'untiled':>8} {'stock':>8} | "
          f"{'tiled/stock':>11} {'untiled/stock':>13} | {'predicted MiB: tiled':>20} "
          f"{'untiled':>8} | {'measured/predicted: tiled':>25} {'untiled':>8} | "
          f"{'step s: tiled':>13} {'untiled':>8} {'stock':>8} | {'tiled/stock':>11}")
    for seq in args.seqs:
        runs = {mode: _run(mode, seq, args.tile_tokens) for mode in MODES}
        mem = {m: r["peak_growth_bytes"] for m, r in runs.items()}
        pred = {m: r["predicted_growth_bytes"] for m, r in runs.items()}
        step = {m: r["step_s"] for m, r in runs.items()}
        print(f"{seq:>7} | {mem['tiled'] / MIB:>22.0f} {mem['untiled'] / MIB:>8.0f} "
              f"{mem['stock'] / MIB:>8.0f} | {mem['tiled'] / mem['stock']:>11.2f} "
              f"{mem['untiled'] / mem['stock']:>13.2f} | {pred['tiled'] / MIB:>20.0f} "
              f"{pred['untiled'] / MIB:>8.0f} | {mem['tiled'] / pred['tiled']:>25.2f} "
              f"{mem['untiled'] / pred['untiled']:>8.2f} | {step['tiled']:>13.1f} "
              f"{step['untiled']:>8.1f} {step['stock']:>8.1f} | "
              f"{step['tiled'] / step['stock']:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
