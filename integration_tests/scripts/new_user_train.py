"""The plugin script a new user writes first: a tiny model, `Accelerator(cpu=True)` with
the plugin, a few steps, and nothing at the end (no `wait_for_everyone`, no
`end_training`): whatever the plugin started must still end cleanly at exit.

`--steps N`; `--verbose` shows the plugin's INFO lines (the plan each rank runs). The
environment variable LAZYTRAIN_TEST_RANK1_PLAN, when set, gives rank 1 another plan
strategy than the others (a launch whose ranks disagree); LAZYTRAIN_TEST_RANK1_GPU_GB
gives rank 1 a device budget of that many GiB (ranks with uneven memory).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--plan", default="megatrain")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = Qwen2ForCausalLM(config)
    plan = args.plan
    if os.environ.get("RANK") == "1" and os.environ.get("LAZYTRAIN_TEST_RANK1_PLAN"):
        plan = os.environ["LAZYTRAIN_TEST_RANK1_PLAN"]
    rank1_gpu_gb = os.environ.get("LAZYTRAIN_TEST_RANK1_GPU_GB")
    budget = {"gpu_memory_limit_gb": float(rank1_gpu_gb)} if (
        os.environ.get("RANK") == "1" and rank1_gpu_gb) else {}
    accelerator = Accelerator(cpu=True, plugin=LazyTrainPlugin(plan=plan, **budget))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(32).reshape(2, 16) % config.vocab_size
    for _ in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {accelerator.process_index}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
