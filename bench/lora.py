"""What LoRA and QLoRA buy, in the planner (issue 17): full fine-tune vs LoRA on a bf16
base vs QLoRA on an nf4 base, for llama3-8b and llama3-70b on RTX 3090/4090 (64 and
128 GB host) and an H800. Planner only (no GPU, no weights); never collected by pytest.

    python bench/lora.py [--time-limit-s 10] [--rank 16] [--batch-limit 64]

Columns: host bytes = the plan's simulated host peak at micro-batch 1 x 1024 (masters,
gradients, optimizer state, frozen weights as stored, staging); PCIe bytes per step =
H2D + D2H of that step (weights, gradients, activations); tokens/s = the simulated step
at the largest micro-batch that plans at 1024 tokens (searched up to --batch-limit);
max micro-batch at 1024 and 4096 tokens; dequant = the share of the step (at micro-batch
1 / at the largest) the device spends dequantizing packed weights (bitsandbytes, once
per forward, forward re-run, recompute and backward of each layer, at the preset's
`dequant_bytes_per_s`). The loss head is "auto" (the planner may pick the fused
chunked loss). Ratios are against the full fine-tune of the same row.
"""

from __future__ import annotations

import argparse

from lazytrain_accel.planning import (
    Budgets,
    PlanInfeasibleError,
    PlanRequest,
    make_plan,
    max_batch_size,
    simulate,
)
from lazytrain_accel.planning.plan import Home
from lazytrain_accel.planning.problem import GIB
from lazytrain_accel.profiling.adapters import lora_profile_inputs
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
    with_loss_chunk,
)

MODELS = ("llama3-8b", "llama3-70b")
#: (label, hardware preset, host GiB; 0 = the preset's own)
MACHINES = (("rtx3090, 64 GB", "rtx3090", 64), ("rtx3090, 128 GB", "rtx3090", 128),
            ("rtx4090, 64 GB", "rtx4090", 64), ("rtx4090, 128 GB", "rtx4090", 128),
            ("h800, 1 TB", "h800", 0))
#: (label, frozen format or None for a full fine-tune)
MODES = (("full", None), ("LoRA (bf16 base)", "bf16"), ("QLoRA (nf4 base)", "nf4"))


def profile_at(preset: str, fmt: str | None, rank: int, seq_len: int):
    """`profile(batch)` of one row: the model, full or with rank-`rank` adapters."""
    geometry, weights = geometry_from_config(load_model_config(preset), name=preset), None
    if fmt is not None:
        geometry, weights = lora_profile_inputs(geometry, rank=rank, frozen_format=fmt)

    def profile(batch_size: int):
        return profile_model(geometry, batch_size=batch_size, seq_len=seq_len,
                             loss_chunk_tokens=None, weights=weights)
    return profile


def pcie_bytes(result, hw) -> float:
    """H2D + D2H bytes of one simulated step (each op lasts its bytes / its link's rate)."""
    rate = {"h2d": hw.h2d_bytes_per_s, "d2h": hw.d2h_bytes_per_s}
    return sum(op.duration_s * rate[op.resource] for op in result.ops if op.resource in rate)


def row(preset: str, machine: tuple[str, str, int], mode: tuple[str, str | None],
        args: argparse.Namespace) -> dict:
    label, hw_name, host_gib = machine
    hw = HARDWARE_PRESETS[hw_name]
    budgets = Budgets.from_hardware(hw, cpu_memory_limit_gb=host_gib)
    request = PlanRequest(budgets=budgets, time_limit_s=args.time_limit_s)
    out = {"model": preset, "machine": label, "mode": mode[0]}
    at_1k = profile_at(preset, mode[1], args.rank, 1024)
    try:
        one = at_1k(1)
        plan = make_plan(one, hw, request)
        sim = simulate(plan, plan_profile(plan, one), hw)
        out.update(host_bytes=sim.peak_cpu_bytes, pcie_bytes=pcie_bytes(sim, hw),
                   tokens_per_s_1=sim.tokens_per_s,
                   dequant_share_1=dequant_s(plan, one, hw) / sim.step_s)
        best = max_batch_size(at_1k, hw, request, limit=args.batch_limit)
        big = make_plan(at_1k(best), hw, request)
        out.update(batch_1k=best, tokens_per_s=big.prediction.tokens_per_s,
                   dequant_share=dequant_s(big, at_1k(best), hw) / big.prediction.step_s)
        try:
            out["batch_4k"] = max_batch_size(profile_at(preset, mode[1], args.rank, 4096), hw,
                                             request, limit=args.batch_limit)
        except PlanInfeasibleError:
            out["batch_4k"] = 0
    except PlanInfeasibleError as err:
        out["refused"] = ", ".join(f"{t.upper()} short {b / GIB:.0f} GiB"
                                   for t, b in err.shortfall_bytes.items())
    return out


def dequant_s(plan, profile, hw) -> float:
    """Device seconds of one step spent dequantizing packed weights: per layer a forward,
    a forward re-run and a backward, plus one forward per recomputed layer."""
    w = profile.weights
    if w is None:
        return 0.0
    passes = 3 * plan.num_layers + sum(h == Home.RECOMPUTE for h in plan.homes)
    return passes * w.layer_dequant_bytes(profile.compute_bytes_per_elem) / hw.dequant_bytes_per_s


def plan_profile(plan, profile):
    """The profile the plan was made for (the planner may have chosen a loss chunk)."""
    return with_loss_chunk(profile, plan.loss_chunk_tokens or 0)


def print_table(rows: list[dict], batch_limit: int) -> None:
    print("| model | machine | run | host GiB | PCIe GB/step (b=1) | tokens/s at b=1 | "
          "tokens/s at max b | dequant (b=1 / max b) | max b @1024 | max b @4096 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    full: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["model"], r["machine"])
        if r["mode"] == "full":
            full[key] = r
        head = f"| {r['model']} | {r['machine']} | {r['mode']} |"
        if "refused" in r:
            print(f"{head} does not fit ({r['refused']}) | | | | | | |")
            continue
        base = full.get(key)
        base = base if base is not None and "refused" not in base and r is not base else None
        print(f"{head} {r['host_bytes'] / GIB:.1f} | {r['pcie_bytes'] / 1e9:.1f} | "
              f"{_speed(r, base, 'tokens_per_s_1')} | {_speed(r, base, 'tokens_per_s')} | "
              f"{100 * r['dequant_share_1']:.1f}% / {100 * r['dequant_share']:.1f}% | "
              f"{_cap(r['batch_1k'], batch_limit)} | {_cap(r['batch_4k'], batch_limit)} |")


def _speed(r: dict, base: dict | None, key: str) -> str:
    return f"{r[key]:.0f}" + (f" ({r[key] / base[key]:.1f}x)" if base else "")


def _cap(batch: int, limit: int) -> str:
    return f">= {batch}" if batch >= limit else str(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-limit-s", type=float, default=10.0)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch-limit", type=int, default=64)
    args = parser.parse_args()
    rows = [row(m, machine, mode, args) for m in MODELS for machine in MACHINES
            for mode in MODES]
    print(f"LoRA rank {args.rank} on every linear (all-linear), bf16 compute, seq 1024/4096")
    print_table(rows, args.batch_limit)


if __name__ == "__main__":
    main()
