"""`replan="auto"` on a launch of one or more ranks: bench/replan.py's tiny model, planned
on a profile that claims NVMe 20x faster than the emulated links run, every rank on the
same batch. Writes each rank's losses and the steps at which it took a new plan to
`--out`/rank<N>.json.

    accelerate launch [--multi_gpu --num_processes 2] replan_ranks_train.py \
        --hardware claimed.json --links true.json --steps 8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import replan

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.run.replan_ranks import LaunchReplanner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hardware", required=True)
    p.add_argument("--links", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ids = replan.batch()
    # node_store="off": a copy per rank, so two ranks plan as one process does
    plugin = LazyTrainPlugin(hardware=args.hardware, emulate_async=True, node_store="off",
                             emulate_links=args.links, replan="auto", solver_time_limit_s=20,
                             batch_size=ids.shape[0], seq_len=ids.shape[1],
                             **replan.budget_limits_gb())
    model = replan.tiny_model()
    accelerator = Accelerator(cpu=True, plugin=plugin)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(),
                                                                    lr=1e-3))
    losses = []
    for _ in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    replanner = accelerator.lazytrain.replanner
    changes = (replanner.adopted if isinstance(replanner, LaunchReplanner)
               else replanner.switches + replanner.reverts)
    homes = [h.value for h in accelerator.lazytrain.engine.plan.homes]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{accelerator.process_index}.json").write_text(json.dumps(
        {"losses": losses, "plan_changes": changes, "homes": homes}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
