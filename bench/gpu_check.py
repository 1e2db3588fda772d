"""The prepared GPU check: equivalence, throughput and plan fidelity, one script, < 8 min.

On a CUDA machine: (1) the engine equivalence suite on CUDA (`bench/gpu_equivalence.py`: 9
families x 5 plan kinds, bf16 against stock on the same GPU); (2) link bandwidths and the
bf16 matmul rate, and the paper's 27B workload (`h800` preset) planned again with this
host's measured 8-bit update rate in place of the preset's estimate (LazyTrain / MegaTrain
TFLOPS: the 27B ratio depends on that rate, docs/benchmarks.md); (3) QLoRA
(`bench/gpu_qlora.py`: a bf16 Llama base loaded nf4 and int8 with `BitsAndBytesConfig`,
PEFT LoRA, trained through the plugin against stock Accelerate on the same GPU; the
measured nf4 dequantization rate beside the preset's); (4) a Qwen2.5-3B-geometry model
(random init, bf16, seq 1024) trained through the Accelerate plugin
(`Accelerator(plugin=LazyTrainPlugin(...))`, the overlapped hybrid 8-bit step) with the
LazyTrain MIP plan, `megatrain` and `checkpoint_all` under GPU caps of 24 and 80 GiB, 2
warm-up + 5 timed steps each, plus each strategy's largest admitted batch under 24 GiB.
Each run reports the measured step (start to start, so the overlapped update counts where
it is exposed) beside the simulator's prediction with the optimizer
(`simulate(include_optimizer=True)`), and the measured optimizer exposure
(`StepStats.optimizer_wait_s`) beside the predicted one. Writes `gpu_check.json` (after
every phase and run, so a timeout keeps what ran; the seconds of each phase in `phase_s`)
and `gpu_check.txt` into the output folder. No 3B run starts once the elapsed time plus
the longest run so far (scaled up to its batch) would pass `BUDGET_S` (it is listed as
skipped), so the check ends by itself inside `gpu_check.sh`'s `timeout 470`.

`--dry-run` runs the same code path on the CPU with tiny models (a test runs it).

    python bench/gpu_check.py OUT_DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

import gpu_equivalence
import gpu_pinning
import gpu_qlora

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.config import env_setting
from lazytrain_accel.demo.budget import demo_gpu_budget_gb
from lazytrain_accel.planning import (
    Budgets,
    PlanInfeasibleError,
    make_plan,
    max_batch_size,
    simulate,
)
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HardwareProfile, preset_for_gpu
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)
from lazytrain_accel.profiling.profile import ModelProfile

_GIB = 1024**3
STRATEGIES = ("lazytrain", "megatrain", "checkpoint_all")
#: Seconds after which no new training run starts (`gpu_check.sh` kills at 470).
BUDGET_S = 430.0


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
    equivalence_archs: list[str] | None  # None: every family of the suite
    equivalence_kinds: list[str] | None  # None: every plan kind
    qlora: gpu_qlora.QloraSetting


def real_setting() -> Setting:
    return Setting(model_config=load_model_config("qwen2.5-3b"), seq_len=1024, batch_size=8,
                   caps_gib=(24.0, 80.0), warmup_steps=2, timed_steps=5,
                   device=torch.device("cuda"), compute_dtype=torch.bfloat16,
                   equivalence_archs=None, equivalence_kinds=None,
                   qlora=gpu_qlora.real_setting())


def dry_setting() -> Setting:
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64).to_dict()
    # Caps set in main() from the tiny model's MegaTrain footprint, so plans differ.
    return Setting(model_config=config, seq_len=32, batch_size=2, caps_gib=(),
                   warmup_steps=1, timed_steps=2, device=torch.device("cpu"),
                   compute_dtype=None, equivalence_archs=["llama", "gpt2"],
                   equivalence_kinds=["mixed"], qlora=gpu_qlora.dry_setting())


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
    predicted_step_s: float  # with the host optimizer (simulate(include_optimizer=True))
    step_ratio: float  # measured / predicted
    measured_optimizer_exposed_s: float  # the training thread waiting for the update
    predicted_optimizer_exposed_s: float
    optimizer_update_s: float  # the update's own time on its thread
    # the residents' update on the device (the training thread queueing it; 0 on the host)
    device_update_s: float
    resident_update: str  # where the plan put the residents' update
    homes: dict


def measure_links(device: torch.device, nbytes: int) -> dict[str, float]:
    """Pinned H2D / D2H bytes per second and the matmul rate (bf16 on CUDA)."""
    if device.type != "cuda":
        hw = load_hardware("auto", cache_dir=env_setting("cache_dir"),
                           nvme_dir=env_setting("nvme_dir"))
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


def paper_ratio_at(host_update_params_per_s: float,
                   device_update_scale: float = 1.0) -> dict[str, float]:
    """The paper's workload (qwen3.6-27b, h800, batch 72 x 1024, as `lazytrain plan` runs
    it) with the `h800` preset's host update rate replaced by `host_update_params_per_s`
    (this machine's, measured) and its GPU update rate scaled by `device_update_scale`
    (this GPU's measured rate over its preset's estimate): LazyTrain and MegaTrain TFLOPS
    and their ratio. The preset's rates are estimates, and at 27B the ratio depends on
    them (docs/benchmarks.md)."""
    h800 = load_hardware("h800")
    hardware = dataclasses.replace(
        h800, cpu_optimizer_params_per_s=host_update_params_per_s,
        gpu_optimizer_params_per_s=h800.gpu_optimizer_params_per_s * device_update_scale)
    model = profile_model(geometry_from_config(load_model_config("qwen3.6-27b")),
                          batch_size=72, seq_len=1024, loss_chunk_tokens=None)
    ours = make_plan(model, hardware)
    mega = make_plan(model, hardware, PlanRequest(strategy="megatrain"))
    return {"host_update_params_per_s": host_update_params_per_s,
            "device_update_params_per_s": hardware.gpu_optimizer_params_per_s,
            "resident_update": ours.resident_update,
            "lazytrain_tflops": ours.prediction.tflops,
            "megatrain_tflops": mega.prediction.tflops,
            "ratio": ours.prediction.tflops / mega.prediction.tflops}


def device_update_against_preset(hardware: HardwareProfile) -> dict[str, float | str | None]:
    """This GPU's measured residents' update rate beside the estimate of the preset for
    the same GPU model (None when no preset matches): how good the estimate is."""
    preset = preset_for_gpu(hardware.gpu_name)
    estimate = None if preset is None else preset.gpu_optimizer_params_per_s
    return {"measured_params_per_s": hardware.gpu_optimizer_params_per_s,
            "preset": None if preset is None else preset.name,
            "preset_params_per_s": estimate,
            "measured_over_preset": None if estimate is None
            else hardware.gpu_optimizer_params_per_s / estimate}


def build_model(config: dict) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config))
    model.config.use_cache = False
    return model


@dataclass(kw_only=True)
class Measured:
    step_s: list[float]  # start of step k to start of step k+1: overlap counted as exposed
    stall_s: float
    optimizer_wait_s: float
    optimizer_update_s: float
    device_update_s: float
    peak_device_bytes: int


def train_steps(model: Qwen2ForCausalLM, plugin: LazyTrainPlugin, setting: Setting,
                batch_size: int) -> tuple[Measured, Accelerator]:
    """The user's Accelerate loop through the plugin: clip, overlapped step, zero_grad."""
    ids = torch.randint(0, model.config.vocab_size,
                        (batch_size * (setting.warmup_steps + setting.timed_steps + 1),
                         setting.seq_len), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids),
                                         batch_size=batch_size)
    acc = Accelerator(cpu=setting.device.type == "cpu", plugin=plugin,
                      mixed_precision="no" if setting.compute_dtype is None else "bf16")
    model, optimizer, loader = acc.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01), loader)
    engine = acc.lazytrain.engine
    starts, stalls, waits, updates, device_updates = [], [], [], [], []
    if setting.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step, (batch,) in enumerate(loader):
        if setting.device.type == "cuda":
            torch.cuda.synchronize()
        starts.append(time.perf_counter())
        if step > setting.warmup_steps:  # the stats of the step that just ended
            stats = engine.stats()
            stalls.append(stats.stall_s)
            waits.append(stats.optimizer_wait_s)
            updates.append(stats.optimizer_update_s)
            device_updates.append(stats.device_update_s)
        if step == setting.warmup_steps + setting.timed_steps:
            break
        engine.reset_stats()
        acc.backward(model(input_ids=batch, labels=batch).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # returns while the update runs on its thread
        optimizer.zero_grad(set_to_none=True)
    acc.wait_for_everyone()
    peak = (torch.cuda.max_memory_allocated() if setting.device.type == "cuda"
            else engine.stats().peak_bytes.get("device", 0))
    times = [b - a for a, b in itertools.pairwise(starts)][setting.warmup_steps:]
    return Measured(step_s=times, stall_s=statistics.median(stalls),
                    optimizer_wait_s=statistics.median(waits),
                    optimizer_update_s=statistics.median(updates),
                    device_update_s=statistics.median(device_updates),
                    peak_device_bytes=int(peak)), acc


def _profile(setting: Setting, batch_size: int) -> ModelProfile:
    geometry = geometry_from_config(setting.model_config, name="qwen2.5-3b-geometry")
    elem = 2 if setting.compute_dtype is not None else 4
    return profile_model(geometry, batch_size=batch_size, seq_len=setting.seq_len,
                         compute_bytes_per_elem=elem)


def run_one(strategy: str, cap_gib: float, batch_size: int, setting: Setting,
            model: Qwen2ForCausalLM) -> RunResult:
    if setting.device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap_gib * _GIB / torch.cuda.get_device_properties(0).total_memory))
    plugin = LazyTrainPlugin(plan="auto" if strategy == "lazytrain" else strategy,
                             hardware="auto", gpu_memory_limit_gb=cap_gib,
                             solver_time_limit_s=30)
    measured, acc = train_steps(model, plugin, setting, batch_size)
    run = acc.lazytrain.run
    predicted = simulate(run.plan, run.model_profile, run.hardware, include_optimizer=True)
    acc.end_training()
    step_s = statistics.median(measured.step_s)
    tokens = batch_size * setting.seq_len
    return RunResult(strategy=strategy, cap_gib=cap_gib, batch_size=batch_size, step_s=step_s,
                     tokens_per_s=tokens / step_s,
                     tflops=6 * run.model_profile.geometry.total_param_count * tokens
                     / step_s / 1e12,
                     peak_device_bytes=measured.peak_device_bytes,
                     measured_stall_s=measured.stall_s,
                     predicted_exposed_s=predicted.exposed_s,
                     predicted_step_s=predicted.step_s, step_ratio=step_s / predicted.step_s,
                     measured_optimizer_exposed_s=measured.optimizer_wait_s,
                     predicted_optimizer_exposed_s=predicted.optimizer_exposed_s,
                     optimizer_update_s=measured.optimizer_update_s,
                     device_update_s=measured.device_update_s,
                     resident_update=run.plan.resident_update,
                     homes=run.plan.count_homes())


def admitted_batches(setting: Setting, hardware: HardwareProfile, cap_gib: float
                     ) -> dict[str, int]:
    budgets = Budgets.from_hardware(hardware, gpu_memory_limit_gb=cap_gib)
    admitted = {}
    for s in STRATEGIES:
        try:
            admitted[s] = max_batch_size(
                lambda b: _profile(setting, b), hardware,
                PlanRequest(strategy=s, budgets=budgets, time_limit_s=20), limit=64)
        except PlanInfeasibleError:
            admitted[s] = 0
    return admitted


def format_table(results: list[RunResult]) -> str:
    head = (f"{'strategy':<15}{'cap GiB':>9}{'batch':>7}{'step s':>9}{'pred s':>9}"
            f"{'ratio':>7}{'tok/s':>10}{'TFLOPS':>8}{'peak GiB':>10}{'stall s':>9}"
            f"{'opt exp s':>10}{'pred opt':>10}{'upd s':>8}")
    rows = [head]
    for r in results:
        rows.append(f"{r.strategy:<15}{r.cap_gib:>9.4g}{r.batch_size:>7}{r.step_s:>9.3f}"
                    f"{r.predicted_step_s:>9.3f}{r.step_ratio:>7.2f}{r.tokens_per_s:>10.0f}"
                    f"{r.tflops:>8.2f}{r.peak_device_bytes / _GIB:>10.2f}"
                    f"{r.measured_stall_s:>9.3f}{r.measured_optimizer_exposed_s:>10.3f}"
                    f"{r.predicted_optimizer_exposed_s:>10.3f}{r.optimizer_update_s:>8.3f}")
    return "\n".join(rows)


def _write(out_dir: Path, report: dict) -> None:
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))


def _train_runs(setting: Setting, hardware: HardwareProfile, report: dict,
                out_dir: Path, t_start: float) -> list[RunResult]:
    model = build_model(setting.model_config)
    runs = [(s, cap, setting.batch_size) for cap in setting.caps_gib for s in STRATEGIES]
    admitted = admitted_batches(setting, hardware, setting.caps_gib[0])
    report["admitted_batch_at_smallest_cap"] = admitted
    runs += [(s, setting.caps_gib[0], b) for s, b in admitted.items()
             if 0 < b != setting.batch_size]
    results, longest_s = [], 0.0  # the longest run so far, per batch of `setting`'s
    for strategy, cap, batch in runs:
        started = time.perf_counter()
        expected_s = longest_s * max(1.0, batch / setting.batch_size)
        if started - t_start + expected_s > BUDGET_S:  # would not end before the timeout
            report["skipped"].append({"strategy": strategy, "cap_gib": cap,
                                      "batch_size": batch})
            continue
        try:
            results.append(run_one(strategy, cap, batch, setting, model))
            report["runs"].append(asdict(results[-1]))
        except PlanInfeasibleError as err:  # a strategy that does not fit is a result too
            report["refused"].append({"strategy": strategy, "cap_gib": cap,
                                      "batch_size": batch, "error": str(err)})
        longest_s = max(longest_s, (time.perf_counter() - started)
                        / max(1.0, batch / setting.batch_size))
        _write(out_dir, report)
    return results


def _first_phases(setting: Setting, report: dict, out_dir: Path) -> tuple[
        list[gpu_equivalence.EquivalenceResult], HardwareProfile]:
    """Equivalence, links, QLoRA: each written to the report as it ends, timed."""
    start = time.perf_counter()
    equivalence = gpu_equivalence.check_all(setting.device, setting.equivalence_archs,
                                            setting.equivalence_kinds)
    report["equivalence"] = gpu_equivalence.as_dicts(equivalence)
    print(gpu_equivalence.format_table(equivalence), flush=True)
    report["phase_s"]["equivalence"], start = time.perf_counter() - start, time.perf_counter()
    report["links"] = measure_links(setting.device,
                                    256 * 2**20 if setting.device.type == "cuda" else 2**20)
    # 1 GiB in 256 MiB chunks on the GPU (4 registrations), 4 MiB here
    pin_bytes = 2**30 if setting.device.type == "cuda" else 4 * 2**20
    report["pinning"] = gpu_pinning.run_phase(setting.device, pin_bytes, pin_bytes // 4)
    hardware = load_hardware("auto", cache_dir=env_setting("cache_dir"),
                             nvme_dir=env_setting("nvme_dir"))
    report["hardware"] = hardware.to_dict()
    report["device_update"] = device_update_against_preset(hardware)
    report["paper_27b"] = paper_ratio_at(
        hardware.cpu_optimizer_params_per_s,
        report["device_update"]["measured_over_preset"] or 1.0)
    report["phase_s"]["links"], start = time.perf_counter() - start, time.perf_counter()
    _write(out_dir, report)
    report["qlora"] = gpu_qlora.run_phase(setting.qlora, hardware)
    print(gpu_qlora.format_table(report["qlora"]), flush=True)
    report["phase_s"]["qlora"] = time.perf_counter() - start
    _write(out_dir, report)
    return equivalence, hardware


def _summarize(setting: Setting, report: dict, results: list[RunResult],
               equivalence: list[gpu_equivalence.EquivalenceResult], out_dir: Path) -> None:
    """`gpu_check.txt`, and the tables on stdout."""
    table = format_table(results)
    (out_dir / "gpu_check.txt").write_text(
        gpu_equivalence.format_table(equivalence) + "\n" + json.dumps(report["links"])
        + "\n" + json.dumps(report["paper_27b"]) + "\n" + gpu_qlora.format_table(
            report["qlora"]) + "\n" + table + "\n")
    print(json.dumps(report["links"]))
    print(f"the node store's pinning in chunks: {json.dumps(report['pinning'])}")
    print(f"the residents' GPU update, measured vs the preset's estimate: "
          f"{json.dumps(report['device_update'])}")
    print(f"paper workload (27B, h800 preset) at this host's update rate: "
          f"{json.dumps(report['paper_27b'])}")
    print(table)
    print(f"admitted batch under {setting.caps_gib[0]:.4g} GiB: "
          f"{report['admitted_batch_at_smallest_cap']}")
    for r in report["refused"]:
        print(f"refused: {r['strategy']} at {r['cap_gib']:.4g} GiB, batch {r['batch_size']}")
    for r in report["skipped"]:
        print(f"skipped (time budget): {r['strategy']} at {r['cap_gib']:.4g} GiB, "
              f"batch {r['batch_size']}")
    print(f"phase seconds: {json.dumps(report['phase_s'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny models on the CPU: proves the path works without a GPU")
    args = parser.parse_args(argv)
    setting = dry_setting() if args.dry_run else real_setting()
    if setting.device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report: dict = {"dry_run": args.dry_run, "runs": [], "refused": [], "skipped": [],
                    "phase_s": {}}
    equivalence, hardware = _first_phases(setting, report, args.out_dir)
    if not setting.caps_gib:  # dry run: the tiny model's MegaTrain footprint, and twice it
        tight_gib = demo_gpu_budget_gb(_profile(setting, setting.batch_size), hardware)
        setting.caps_gib = (tight_gib, 2 * tight_gib)
    start = time.perf_counter()
    results = _train_runs(setting, hardware, report, args.out_dir, t_start)
    report["phase_s"]["training"] = time.perf_counter() - start
    report["wall_s"] = time.perf_counter() - t_start
    _write(args.out_dir, report)
    _summarize(setting, report, results, equivalence, args.out_dir)
    ok = all(e.passed for e in equivalence) and gpu_qlora.passed(report["qlora"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
