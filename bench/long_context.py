"""Peak memory growth and step time of one long sample, 4K to 32K tokens, on this CPU:
streaming through the Accelerate plugin with the whole layer in sequence tiles (`layer`),
the MLP only tiled (`tiled`) and untiled, and stock transformers with gradient
checkpointing, each step in a fresh process (`long_context_run.py`); printed
side by side with the ratios to stock, and the planner's predicted growth of the plugin's
steps (`long_context_run.predicted_growth_bytes`) with measured / predicted.

    PYTHONPATH=. python bench/long_context.py [--seqs 4096 8192 16384 32768]
        [--tile-tokens 2048] [--modes layer tiled untiled stock]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "long_context_run.py"
MODES = ("layer", "tiled", "untiled", "stock")
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
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="stock is always run (the ratios' reference)")
    args = parser.parse_args()
    modes = [m for m in args.modes if m != "stock"]
    print(" | ".join(["tokens"] + [f"{m}: peak growth MiB, /stock, predicted MiB, "
                                   "measured/predicted, step s" for m in modes]
                     + ["stock: peak growth MiB, step s"]))
    for seq in args.seqs:
        runs = {mode: _run(mode, seq, args.tile_tokens) for mode in [*modes, "stock"]}
        stock = runs["stock"]
        cells = [f"{seq:>7}"]
        for m in modes:
            r = runs[m]
            cells.append(f"{r['peak_growth_bytes'] / MIB:.0f}, "
                         f"{r['peak_growth_bytes'] / stock['peak_growth_bytes']:.2f}, "
                         f"{r['predicted_growth_bytes'] / MIB:.0f}, "
                         f"{r['peak_growth_bytes'] / r['predicted_growth_bytes']:.2f}, "
                         f"{r['step_s']:.1f}")
        cells.append(f"{stock['peak_growth_bytes'] / MIB:.0f}, {stock['step_s']:.1f}")
        print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
