"""Planner benchmarks: MIP solve time and gap per instance class, the paper's H800 table
in simulation, and max batch on an RTX 3090. Prints ratios; never collected by pytest.

    python bench/planner.py [--skip-solve] [--skip-tables] [--time-limit-s 60] [--verbose]
        [--chains 12] [--seed 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan, max_batch_size
from lazytrain_accel.planning.problem import Problem, build_problem
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.solve import solve_problem, with_device_residents
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "planning"))
from planner_chains import tight_chains  # the property test's tight class

PAPER = (("qwen2.5-3b", 192, 142.80, 176.42), ("qwen2.5-7b", 144, 161.35, 199.84),
         ("qwen2.5-14b", 96, 171.92, 212.34), ("qwen3.6-27b", 72, 176.90, 219.95))
PAPER_3090 = {"qwen2.5-3b": (7, 8), "qwen2.5-7b": (5, 6), "qwen2.5-14b": (3, 4),
              "qwen3.6-27b": (1, 2)}
SEQ_LEN = 1024
GAP = 0.001  # the planner's default stopping gap


def profile(preset: str, batch_size: int, loss_chunk_tokens: int | None = None):
    geometry = geometry_from_config(load_model_config(preset), name=preset)
    return profile_model(geometry, batch_size=batch_size, seq_len=SEQ_LEN,
                         loss_chunk_tokens=loss_chunk_tokens)


def tight_budgets(model, hardware) -> Budgets:
    """DESIGN.md's tight case: 10.8 GB of GPU for activations, 8 GB CPU, 8 GB NVMe."""
    p = build_problem(model, hardware)
    gpu = int((p.gpu_fixed_bytes - p.gpu_reserve_bytes + 10.8e9) / 0.96)
    return Budgets(gpu_bytes=gpu, cpu_bytes=p.cpu_fixed_bytes + int(8e9), nvme_bytes=int(8e9))


def classes(chains: int = 12, seed: int = 15) -> dict[str, list[Problem]]:
    h800 = HARDWARE_PRESETS["h800"]
    request = profile("qwen3.6-27b", 40, loss_chunk_tokens=8192)
    issue = [build_problem(request, h800, budgets=Budgets.from_hardware(h800, 30, cpu, 8))
             for cpu in (258, 262)]
    deep = [build_problem(m, h800, budgets=tight_budgets(m, h800))
            for m in (profile("llama3-70b", b, 4096) for b in (8, 16, 32))]
    return {"tight 64-layer chains (property test class)": tight_chains(chains, seed),
            "27B request of issue 15, host 258 / 262 GiB": issue,
            "llama3-70b (80 layers), tight GPU/host/NVMe": deep}


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """(median, p90, max) of `values`."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return statistics.median(ordered), p90, ordered[-1]


def _solve_one(p: Problem, time_limit_s: float) -> tuple[float, float, str, float]:
    """(wall s, CPU s, outcome, gap) of one `lazytrain` solve as `make_plan` runs it."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        solution = solve_problem(p, strategy="lazytrain", time_limit_s=time_limit_s, gap=GAP)
        outcome, gap = solution.status, solution.gap
    except PlanInfeasibleError:
        outcome, gap = "refused (proven infeasible)", 0.0
    return time.perf_counter() - wall, time.process_time() - cpu, outcome, gap


def solve_times(time_limit_s: float, verbose: bool = False, chains: int = 12,
                seed: int = 15) -> None:
    """Wall and CPU seconds (this process's, so load from other processes does not count)
    of every solve, per class; the load average beside them says how loaded the wall
    figures are."""
    print(f"## MIP solve time per class (lazytrain strategy, gap {GAP:.1%}, warm start, "
          f"time limit {time_limit_s:.0f} s; load average at start "
          f"{os.getloadavg()[0]:.2f})")
    print("| class | n | wall median / p90 / max s | CPU median / p90 / max s | max gap "
          "| outcomes |")
    print("|---|---|---|---|---|---|")
    for name, problems in classes(chains, seed).items():
        runs = [_solve_one(p, time_limit_s) for p in problems]
        if verbose:
            for k, (wall, cpu, outcome, gap) in enumerate(runs):
                print(f"<!-- {name} #{k}: wall {wall:.2f} s, CPU {cpu:.2f} s, {outcome}, "
                      f"gap {gap:.3%} -->")
        outcomes: dict[str, int] = {}
        for run in runs:
            outcomes[run[2]] = outcomes.get(run[2], 0) + 1
        wall = "{:.2f} / {:.2f} / {:.2f}".format(*_quantiles([r[0] for r in runs]))
        cpu = "{:.2f} / {:.2f} / {:.2f}".format(*_quantiles([r[1] for r in runs]))
        summary = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
        print(f"| {name} | {len(problems)} | {wall} | {cpu} | {max(r[3] for r in runs):.2%} "
              f"| {summary} |")
    print(f"<!-- load average at end {os.getloadavg()[0]:.2f} -->")


def paper_table(time_limit_s: float) -> None:
    hw = HARDWARE_PRESETS["h800"]
    print("\n## Paper table in simulation (h800, seq 1024, loss_chunk_tokens=auto, the "
          "optimizer overlapped in both)")
    print("| model | batch | MegaTrain TFLOPS | LazyTrain TFLOPS | ratio | ratio, megatrain "
          "given the GPU residents | ratio w/o optimizer | paper ratio | LazyTrain g/c/n/r "
          "| residents | loss chunk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, batch, paper_mega, paper_lazy in PAPER:
        model = profile(preset, batch)
        plans = {s: make_plan(model, hw, PlanRequest(strategy=s, time_limit_s=time_limit_s))
                 for s in ("megatrain", "lazytrain")}
        bare = {s: make_plan(model, hw, PlanRequest(strategy=s, time_limit_s=time_limit_s,
                                                    include_optimizer=False)).prediction.tflops
                for s in plans}
        mega, lazy = plans["megatrain"].prediction, plans["lazytrain"].prediction
        given = with_device_residents(plans["megatrain"], model, hw, Budgets.from_hardware(hw))
        like = lazy.tflops / (given or plans["megatrain"]).prediction.tflops
        counts = plans["lazytrain"].count_homes()
        homes = "/".join(str(counts[k]) for k in ("gpu", "cpu", "nvme", "recompute"))
        print(f"| {preset} | {batch} | {mega.tflops:.1f} | {lazy.tflops:.1f} | "
              f"{lazy.tflops / mega.tflops:.3f}x | {like:.3f}x "
              f"| {bare['lazytrain'] / bare['megatrain']:.3f}x "
              f"| {paper_lazy / paper_mega:.3f}x | {homes} | "
              f"{plans['lazytrain'].resident_update} | {plans['lazytrain'].loss_chunk_tokens} |")


def max_batches(time_limit_s: float) -> None:
    hw = HARDWARE_PRESETS["rtx3090"]
    print("\n## Max batch on rtx3090 (seq 1024, HF's unchunked loss: loss_chunk_tokens=0)")
    print("| model | MegaTrain | LazyTrain | ratio | paper MegaTrain / LazyTrain | search s |")
    print("|---|---|---|---|---|---|")
    for preset, (paper_mega, paper_lazy) in PAPER_3090.items():
        def at(b: int, preset: str = preset):
            return profile(preset, b, loss_chunk_tokens=0)

        start = time.perf_counter()
        sizes = {}
        for strategy in ("megatrain", "lazytrain"):
            try:
                sizes[strategy] = max_batch_size(at, hw, PlanRequest(strategy=strategy,
                                                                     time_limit_s=time_limit_s))
            except ValueError as err:
                sizes[strategy] = 0
                print(f"<!-- {preset} {strategy}: {err} -->")
        ratio = sizes["lazytrain"] / sizes["megatrain"] if sizes["megatrain"] else float("nan")
        print(f"| {preset} | {sizes['megatrain']} | {sizes['lazytrain']} | {ratio:.2f}x | "
              f"{paper_mega} / {paper_lazy} | {time.perf_counter() - start:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--skip-solve", action="store_true")
    parser.add_argument("--skip-tables", action="store_true")
    parser.add_argument("--verbose", action="store_true",
                        help="one line per solve (wall, CPU, outcome, gap)")
    parser.add_argument("--chains", type=int, default=12,
                        help="how many tight 64-layer chains (seeded, see --seed)")
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args()
    if not args.skip_solve:
        solve_times(args.time_limit_s, verbose=args.verbose, chains=args.chains,
                    seed=args.seed)
    if not args.skip_tables:
        paper_table(args.time_limit_s)
        max_batches(args.time_limit_s)


if __name__ == "__main__":
    main()
