"""The plan's printed step against the steps it then runs (issue 43), as a new user meets
it: `hardware="auto"`, the plan made at `prepare`, its predicted step beside the median of
the measured steps. Each run is a fresh process; a cache directory is either empty or
holds what another model's run left in it (its machine profile, its calibration, its
workload rates).

    PYTHONPATH=. python bench/prediction.py [--steps 40]

Models: the demo (`lazytrain demo`: its plan table's "step (s)" of this run's column
against the median of its timed steps, all but the first and the traced one, from its
demo_summary.json; the progress lines print one step in ten), an 8-layer 256-wide
Llama at batch 4 x 64, and a QLoRA run of it (nf4 base quantized at `prepare`, LoRA r=8
on every linear with PEFT). The Llama runs print the plan's `prediction.step_s` and
time every optimizer step; the median is over the steps after the first 5.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5


def _llama(qlora: bool) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=8, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=128,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if qlora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    return model


def run_llama(qlora: bool, steps: int) -> dict[str, float]:
    """One run in this process: the plan's predicted step and the measured median."""
    from lazytrain_accel import Accelerator, LazyTrainPlugin

    model = _llama(qlora)
    plugin = LazyTrainPlugin(hardware="auto", batch_size=4, seq_len=64,
                             **({"frozen_weights": "nf4"} if qlora else {}))
    accelerator = Accelerator(cpu=True, plugin=plugin)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    predicted_s = accelerator.lazytrain.run.plan.prediction.step_s
    ids = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(0))
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
    accelerator.end_training()
    return {"predicted_s": predicted_s, "median_s": statistics.median(step_s[WARMUP_STEPS:])}


def run_demo(steps: int, work: Path, env: dict[str, str]) -> dict[str, float]:
    """`lazytrain demo` in a subprocess: its plan table's step and its progress lines."""
    out = subprocess.run([sys.executable, "-m", "lazytrain_accel.cli", "demo", "--steps",
                          str(steps), "--eval-count", "8", "--output-dir", str(work / "demo")],
                         env=env, capture_output=True, text=True, timeout=1800, check=True)
    table = re.search(r"step \(s\)\s*│\s*([\d.]+)", out.stdout)
    summary = json.loads((work / "demo" / "demo_summary.json").read_text())
    return {"predicted_s": float(table.group(1)), "median_s": summary["train"]["median_step_s"]}


def measure(model: str, cache: Path, steps: int) -> dict[str, float]:
    """One fresh process of `model` with `cache` as its cache directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAZYTRAIN_CACHE_DIR": str(cache),
           "LAZYTRAIN_NVME_DIR": str(cache.parent / "nvme")}
    if model == "demo":
        return run_demo(max(steps, 60), cache.parent, env)
    out = subprocess.run([sys.executable, __file__, "--run", model, "--steps", str(steps)],
                         env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--run", choices=("llama", "qlora"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_llama(args.run == "qlora", args.steps)))
        return
    # (cache, model, what the cache held): three caches, each filled in order
    order = [("a", "demo", "fresh"), ("a", "llama", "after the demo"),
             ("a", "qlora", "after the demo and the llama"),
             ("b", "llama", "fresh"), ("b", "demo", "after the llama"), ("c", "qlora", "fresh")]
    print("| model | cache | plan's step (s) | measured median (s) | measured / predicted |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="lazytrain-prediction-") as work:
        for cache, model, held in order:
            result = measure(model, Path(work) / cache / "cache", args.steps)
            ratio = result["median_s"] / result["predicted_s"]
            print(f"| {model} | {held} | {result['predicted_s']:.3f} | "
                  f"{result['median_s']:.3f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
