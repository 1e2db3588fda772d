"""`lazytrain max-seq` for every preset model x GPU: the longest sequence at batch 1, its
predicted step and where the boundaries live (docs/benchmarks.md, "Long context").

    PYTHONPATH=. python bench/max_seq.py [--models llama3-8b ...] [--hardware h200 ...]

Prints a Markdown table. Default budgets: each hardware preset's GPU, host and NVMe.
"""

from __future__ import annotations

import argparse
import time

from lazytrain_accel.planning import PlanInfeasibleError, make_plan
from lazytrain_accel.planning.admission import max_seq_len
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.models import (
    MODEL_PRESETS,
    geometry_from_config,
    load_model_config,
    profile_model,
)

STEP_TOKENS = 1024
LIMIT_TOKENS = 1 << 26


def row(model_name: str, hardware_name: str) -> str:
    geometry = geometry_from_config(load_model_config(model_name), name=model_name)
    hardware = HARDWARE_PRESETS[hardware_name]

    def at(seq_len: int):
        return profile_model(geometry, batch_size=1, seq_len=seq_len, loss_chunk_tokens=None,
                             tile_tokens=None)

    start = time.perf_counter()
    try:
        best = max_seq_len(at, hardware, PlanRequest(time_limit_s=20), step_tokens=STEP_TOKENS,
                           limit_tokens=LIMIT_TOKENS)
    except PlanInfeasibleError:
        return f"| {model_name} | {hardware_name} | < {STEP_TOKENS} | | | | |"
    search_s = time.perf_counter() - start
    plan = make_plan(at(best), hardware, PlanRequest(time_limit_s=20))
    homes = plan.count_homes()
    tiles = (f"{plan.tile_tokens} / {plan.attention_block_tokens or 'whole'}"
             if plan.tile_tokens else "untiled")
    return (f"| {model_name} | {hardware_name} | {best:,} | {plan.prediction.step_s:,.0f} | "
            f"{homes['gpu']} / {homes['cpu']} / {homes['nvme']} / {homes['recompute']} | "
            f"{tiles} | {plan.solver.solve_s:.2f} / {search_s:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[m for m in MODEL_PRESETS
                                                          if m != "tiny-demo"])
    parser.add_argument("--hardware", nargs="+", default=list(HARDWARE_PRESETS))
    args = parser.parse_args()
    print("| model | GPU | max seq (batch 1) | step s | boundaries GPU / CPU / NVMe / "
          "recomputed | tile / query block tokens | solve s / search s |")
    print("|---|---|---|---|---|---|---|")
    for model_name in args.models:
        for hardware_name in args.hardware:
            print(row(model_name, hardware_name), flush=True)


if __name__ == "__main__":
    main()
