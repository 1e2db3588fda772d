"""The prepared GPU check: measured throughput and plan fidelity, one script, < 8 minutes.

On a CUDA machine: link bandwidths and the bf16 matmul rate, then a Qwen2.5-3B-geometry
model (random init, bf16 compute, seq 1024) trained with the LazyTrain MIP plan,
`megatrain` and `checkpoint_all` under GPU caps of 24 and 80 GiB, 2 warm-up + 5 timed
steps each at the same batch, plus each strategy's largest admitted batch under 24 GiB.
Writes `gpu_check.json` and `gpu_check.txt` into the output folder.

`--dry-run` runs the same code path on the CPU with a tiny model (a test runs it).

    python bench/gpu_check.py OUT_DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel.demo.budget import demo_gpu_budget_gb
from lazytrain_accel.engine import attach
from lazytrain_accel.optim import HybridAdamW8bit
from lazytrain_accel.planning import (
    Budgets,
    PlanInfeasibleError,
    make_plan,
    max_batch_size,
    simulate,
)
from lazytrain_accel.profiling.hardware import HardwareProfile, load_hardware
from lazytrain_accel.profiling.model import ModelProfile
from lazytrain_accel.profiling.models import geometry_from_config, load_model_config, profile_model

_GIB = 1024**3
STRATEGIES = ("lazytrain", "megatrain", "checkpoint_all")


@dataclass(kw_only=True)
class Setting:
    model_config: dict
    seq_len: int
    batch_size: int
    caps_gib: tuple[float, ...]
    warmup_steps: int
    timed_steps: int
    device: torch.device
    compute_dtype: torch.dtype | None


def real_setting() -> Setting:
    return Setting(model_config=load_model_config("qwen2.5-3b"), seq_len=1024, batch_size=8,
                   caps_gib=(24.0, 80.0), warmup_steps=2, timed_steps=5,
                   device=torch.device("cuda"), compute_dtype=torch.bfloat16)


def dry_setting() -> Setting:
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64).to_dict()
    # Caps set in main() from the tiny model's MegaTrain footprint, so plans differ.
    return Setting(model_config=config, seq_len=32, batch_size=2, caps_gib=(),
                   warmup_steps=1, timed_steps=2, device=torch.device("cpu"),
                   compute_dtype=None)


@dataclass(kw_only=True)
class RunResult:
    strategy: str
    cap_gib: float
    batch_size: int
    step_s: float
    tokens_per_s: float
    tflops: float
    peak_device_bytes: int
    measured_stall_s: float
    predicted_exposed_s: float
    predicted_step_s: float
    optimizer_s: float
    homes: dict


def measure_links(device: torch.device, nbytes: int) -> dict[str, float]:
    """Pinned H2D / D2H bytes per second and the matmul rate (bf16 on CUDA)."""
    if device.type != "cuda":
        hw = load_hardware("auto")
        return {"h2d_bytes_per_s": hw.h2d_bytes_per_s, "d2h_bytes_per_s": hw.d2h_bytes_per_s,
                "matmul_flops_per_s": hw.achieved_flops_per_s}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d_bytes_per_s": (dev, host),
                             "d2h_bytes_per_s": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 5 * nbytes / (time.perf_counter() - t0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    out["matmul_flops_per_s"] = 20 * 2 * 8192**3 / (time.perf_counter() - t0)
    return out


def build_model(config: dict) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config))
    model.config.use_cache = False
    return model


def train_steps(model: Qwen2ForCausalLM, plan, setting: Setting, batch_size: int
                ) -> tuple[list[float], float, int, float]:
    """Step seconds of each timed step, stall seconds, peak device bytes, optimizer s."""
    nvme_dir = tempfile.mkdtemp(prefix="lazytrain_gpu_check_")
    engine = attach(model, plan, device=setting.device, compute_dtype=setting.compute_dtype,
                    nvme_dir=nvme_dir)
    optimizer = HybridAdamW8bit(model.parameters(), lr=1e-5, weight_decay=0.01,
                                max_grad_norm=1.0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, setting.seq_len), device=setting.device)
    times, stalls, opt_s = [], [], []
    if setting.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        for step in range(setting.warmup_steps + setting.timed_steps):
            engine.reset_stats()
            t0 = time.perf_counter()
            with torch.autocast(setting.device.type, dtype=torch.bfloat16,
                                enabled=setting.compute_dtype is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            t_opt = time.perf_counter()
            engine.step_layerwise(optimizer)
            engine.synchronize()
            optimizer.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            if step >= setting.warmup_steps:
                times.append(t1 - t0)
                opt_s.append(t1 - t_opt)
                stalls.append(engine.stats().stall_s)
        peak = (torch.cuda.max_memory_allocated() if setting.device.type == "cuda"
                else engine.stats().peak_bytes.get("device", 0))
    finally:
        engine.detach()
    return times, statistics.median(stalls), int(peak), statistics.median(opt_s)


def _profile(setting: Setting, batch_size: int) -> ModelProfile:
    geometry = geometry_from_config(setting.model_config, name="qwen2.5-3b-geometry")
    elem = 2 if setting.compute_dtype is not None else 4
    return profile_model(geometry, batch_size=batch_size, seq_len=setting.seq_len,
                         compute_bytes_per_elem=elem)


def run_one(strategy: str, cap_gib: float, batch_size: int, setting: Setting,
            hardware: HardwareProfile, model: Qwen2ForCausalLM) -> RunResult:
    profile = _profile(setting, batch_size)
    geometry = profile.geometry
    budgets = Budgets.from_hardware(hardware, gpu_memory_limit_gb=cap_gib)
    plan = make_plan(profile, hardware, strategy=strategy, budgets=budgets, time_limit_s=30)
    predicted = simulate(plan, profile, hardware)
    if setting.device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap_gib * _GIB / torch.cuda.get_device_properties(0).total_memory))
    times, stall_s, peak, opt_s = train_steps(model, plan, setting, batch_size)
    step_s = statistics.median(times)
    tokens = batch_size * setting.seq_len
    return RunResult(strategy=strategy, cap_gib=cap_gib, batch_size=batch_size, step_s=step_s,
                     tokens_per_s=tokens / step_s,
                     tflops=6 * geometry.total_param_count * tokens / step_s / 1e12,
                     peak_device_bytes=peak, measured_stall_s=stall_s,
                     predicted_exposed_s=predicted.exposed_s,
                     predicted_step_s=predicted.step_s, optimizer_s=opt_s,
                     homes=plan.count_homes())


def admitted_batches(setting: Setting, hardware: HardwareProfile, cap_gib: float
                     ) -> dict[str, int]:
    budgets = Budgets.from_hardware(hardware, gpu_memory_limit_gb=cap_gib)
    admitted = {}
    for s in STRATEGIES:
        try:
            admitted[s] = max_batch_size(lambda b: _profile(setting, b), hardware, strategy=s,
                                         budgets=budgets, time_limit_s=20, limit=64)
        except PlanInfeasibleError:
            admitted[s] = 0
    return admitted


def format_table(results: list[RunResult]) -> str:
    head = (f"{'strategy':<15}{'cap GiB':>9}{'batch':>7}{'step s':>9}{'tok/s':>10}"
            f"{'TFLOPS':>9}{'peak GiB':>10}{'stall s':>9}{'pred exp s':>11}{'opt s':>8}")
    rows = [head]
    for r in results:
        rows.append(f"{r.strategy:<15}{r.cap_gib:>9.4g}{r.batch_size:>7}{r.step_s:>9.3f}"
                    f"{r.tokens_per_s:>10.0f}{r.tflops:>9.2f}{r.peak_device_bytes / _GIB:>10.2f}"
                    f"{r.measured_stall_s:>9.3f}{r.predicted_exposed_s:>11.3f}"
                    f"{r.optimizer_s:>8.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny model on the CPU: proves the path works without a GPU")
    args = parser.parse_args(argv)
    setting = dry_setting() if args.dry_run else real_setting()
    if setting.device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    links = measure_links(setting.device, 256 * 2**20 if not args.dry_run else 2**20)
    hardware = load_hardware("auto")
    if not setting.caps_gib:  # dry run: the tiny model's MegaTrain footprint, and twice it
        tight_gib = demo_gpu_budget_gb(_profile(setting, setting.batch_size), hardware)
        setting.caps_gib = (tight_gib, 2 * tight_gib)
    model = build_model(setting.model_config)
    runs = [(s, cap, setting.batch_size) for cap in setting.caps_gib for s in STRATEGIES]
    admitted = admitted_batches(setting, hardware, setting.caps_gib[0])
    runs += [(s, setting.caps_gib[0], b) for s, b in admitted.items()
             if 0 < b != setting.batch_size]
    results, refused = [], []
    for strategy, cap, batch in runs:
        try:
            results.append(run_one(strategy, cap, batch, setting, hardware, model))
        except PlanInfeasibleError as err:  # a strategy that does not fit is a result too
            refused.append({"strategy": strategy, "cap_gib": cap, "batch_size": batch,
                            "error": str(err)})
    report = {"links": links, "hardware": hardware.to_dict(),
              "admitted_batch_at_smallest_cap": admitted,
              "runs": [asdict(r) for r in results], "refused": refused,
              "wall_s": time.perf_counter() - t_start, "dry_run": args.dry_run}
    (args.out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    table = format_table(results)
    (args.out_dir / "gpu_check.txt").write_text(json.dumps(links) + "\n" + table + "\n")
    print(json.dumps(links))
    print(table)
    print(f"admitted batch under {setting.caps_gib[0]:.4g} GiB: {admitted}")
    for r in refused:
        print(f"refused: {r['strategy']} at {r['cap_gib']:.4g} GiB, batch {r['batch_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
