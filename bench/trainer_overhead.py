"""Seconds per optimizer step of the HF Trainer: stock vs --lazytrain (optimizer kept, and
the hybrid 8-bit default), in one process on the same model and data. Prints ratios.

    python bench/trainer_overhead.py [--model tiny-demo] [--steps 8] [--plan checkpoint_all]

The first step of every run (planning, engine attach, kernel warm-up) is excluded.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, set_seed

from lazytrain_accel.frontends.transformers import LazyTrainTrainer, LazyTrainTrainingArguments
from lazytrain_accel.profiling.model_configs import load_model_config


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.step_s: list[float] = []
        self._start = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.step_s.append(time.perf_counter() - self._start)


def run(model: torch.nn.Module, data: list[dict], *, steps: int, batch: int,
        config: dict | None) -> float:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = LazyTrainTrainingArguments(
            output_dir=out, max_steps=steps + 1, per_device_train_batch_size=batch,
            learning_rate=1e-4, save_strategy="no", report_to="none", use_cpu=True,
            logging_steps=steps + 1, optim="adamw_torch", lazytrain=config is not None,
            lazytrain_config=config)
        LazyTrainTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                         callbacks=[timer]).train()
    return sum(timer.step_s[1:]) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-demo")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--plan", default="checkpoint_all")
    a = p.parse_args()
    set_seed(0)
    config = AutoConfig.for_model(**load_model_config(a.model))
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (a.batch * (a.steps + 1), a.seq), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    stock_s = run(model, data, steps=a.steps, batch=a.batch, config=None)
    keep_s = run(model, data, steps=a.steps, batch=a.batch,
                 config={"plan": a.plan, "optimizer": "keep"})
    hybrid_s = run(model, data, steps=a.steps, batch=a.batch,
                   config={"plan": a.plan, "optimizer": "hybrid8bit"})
    print(f"{a.model}, batch {a.batch} x seq {a.seq}, plan {a.plan}, {a.steps} steps")
    print(f"stock Trainer            {stock_s:.3f} s/step  1.00x")
    print(f"lazytrain, AdamW kept    {keep_s:.3f} s/step  {keep_s / stock_s:.2f}x")
    print(f"lazytrain, hybrid 8-bit  {hybrid_s:.3f} s/step  {hybrid_s / stock_s:.2f}x")


if __name__ == "__main__":
    main()
