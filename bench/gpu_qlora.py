"""The GPU check's QLoRA phase: a packed bitsandbytes base streamed, against stock.

A Llama geometry (random init) is saved in bf16 to a local folder and loaded back the way
QLoRA users load a base: `from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4"))` and `load_in_8bit=True` (LLM.int8),
on the GPU; and loaded bf16 for the plugin's `frozen_weights="nf4"` ("prepare:nf4": the
plugin quantizes at `prepare`, the stock run with the same function by hand). PEFT LoRA
adapters on every projection. Each format is trained twice on the same device with the
user's Accelerate loop (AdamW on the adapters, clip), each on a fresh load: stock
Accelerate (the base on the device), and through `LazyTrainPlugin(optimizer="keep")`
(the packed base moved to the host and streamed as stored: `engine/memory/quantized.py`
`PackedWeightPool`, pinned staging, the H2D side stream, Int8 `CB`/`SCB`). Reported per
format: the losses of both runs (a relative difference above the bf16 tolerance of
`gpu_equivalence` fails), whether the plugin's packed weights (data and scales) after
`prepare` equal the stock run's and are bit-identical after training, the measured step
of both runs and the simulator's predicted step for the QLoRA plan. Beside them: the measured nf4
dequantization rate (`profiling.measure._measure_dequant`) against the hardware preset's
`dequant_bytes_per_s` (an estimate: 0.7 x the vendor's memory bandwidth).

`--dry-run` of `bench/gpu_check.py` runs this on the CPU with a tiny Llama (fp32), the
plugin on the emulated async device (the CUDA code path of the pool: staging, side
stream, events), so the phase is known to work before it meets a GPU.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gpu_equivalence import BF16_REL_TOL  # the relative loss tolerance in bf16
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.engine.memory.quantize_base import quantize_frozen_linears
from lazytrain_accel.engine.memory.quantized import is_packed
from lazytrain_accel.planning import simulate
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.measure import _measure_dequant

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Loaded packed with `BitsAndBytesConfig`; "prepare:nf4": loaded bf16, quantized by the
#: plugin at `prepare` (`frozen_weights="nf4"`; the stock run quantizes it the same way).
FORMATS = ("nf4", "int8", "prepare:nf4")
PREPARE = "prepare:"
#: The check's measured profile, saved beside the base model for the plugin runs.
HARDWARE_JSON = "hardware.json"


@dataclass(kw_only=True)
class QloraSetting:
    model_config: dict
    seq_len: int
    batch_size: int
    warmup_steps: int
    timed_steps: int
    lora_rank: int
    device: torch.device
    compute_dtype: torch.dtype | None  # None: fp32 (the dry run)
    gpu_memory_limit_gb: float
    emulate_async: bool
    dequant_sides: tuple[int, ...]  # square nf4 matrices timed by `_measure_dequant`


def real_setting() -> QloraSetting:
    """TinyLlama-1.1B's geometry with 12 of its 22 layers: 0.66 B parameters (0.53 B in
    the decoder linears: ~0.30 GB packed nf4, ~0.53 GB int8, streamed each pass), 32k
    vocabulary, seq 1024 x batch 4."""
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4,
                         max_position_embeddings=2048, use_cache=False).to_dict()
    return QloraSetting(model_config=config, seq_len=1024, batch_size=4, warmup_steps=1,
                        timed_steps=3, lora_rank=16, device=torch.device("cuda"),
                        compute_dtype=torch.bfloat16, gpu_memory_limit_gb=24.0,
                        emulate_async=False, dequant_sides=(2048, 8192))


def dry_setting() -> QloraSetting:
    """A tiny Llama whose linears are at least one 4-bit block (64) wide (bitsandbytes'
    CPU kernels repack per 64 input features)."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False).to_dict()
    return QloraSetting(model_config=config, seq_len=32, batch_size=2, warmup_steps=1,
                        timed_steps=2, lora_rank=4, device=torch.device("cpu"),
                        compute_dtype=None, gpu_memory_limit_gb=1.0, emulate_async=True,
                        dequant_sides=(256, 512))


@dataclass(kw_only=True)
class QloraResult:
    fmt: str
    packed_tensors: int
    packed_bytes: int
    stock_losses: list[float]
    losses: list[float]
    max_rel_loss_diff: float
    prepared_identical: bool  # the plugin's packed weights at prepare == the stock run's
    packed_as_stock: bool  # after training: bit-identical to stock's packed weights then
    stock_step_s: float
    step_s: float
    predicted_step_s: float  # simulate(include_optimizer=True) of the QLoRA plan
    step_ratio: float  # measured / predicted
    homes: dict
    streams: str  # the engine's streams and weight pool: the path that ran
    pool: str
    passed: bool
    wall_s: float


def _dtype(setting: QloraSetting) -> torch.dtype:
    return setting.compute_dtype or torch.float32


def save_base(setting: QloraSetting, directory: Path) -> None:
    """A random-init Llama, in the compute dtype, saved as a local checkpoint."""
    torch.manual_seed(0)
    with torch.device(setting.device):
        model = LlamaForCausalLM(LlamaConfig(**setting.model_config))
    model.to(_dtype(setting)).save_pretrained(directory)
    del model


def _quantization(fmt: str, setting: QloraSetting) -> BitsAndBytesConfig:
    if fmt == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=fmt,
                              bnb_4bit_compute_dtype=_dtype(setting))


def load_qlora(directory: Path, fmt: str, setting: QloraSetting) -> torch.nn.Module:
    """The base as QLoRA users load it (packed on the device; a "prepare:" format in the
    compute dtype), LoRA adapters on top."""
    import peft

    where = (setting.device.index or 0) if setting.device.type == "cuda" else "cpu"
    quantization = ({} if fmt.startswith(PREPARE)
                    else {"quantization_config": _quantization(fmt, setting)})
    model = LlamaForCausalLM.from_pretrained(directory, dtype=_dtype(setting),
                                             device_map={"": where},  # as the PEFT docs
                                             **quantization)
    model.config.use_cache = False
    return peft.get_peft_model(model, peft.LoraConfig(
        r=setting.lora_rank, lora_alpha=2 * setting.lora_rank, target_modules=TARGETS,
        lora_dropout=0.0))


def packed_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of every packed weight and its scales (4-bit absmax; LLM.int8 SCB, on
    the weight or, after a stock forward, in its module's state)."""
    out = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")  # its own (PEFT wrappers forward theirs)
        if weight is None or not is_packed(weight):
            continue
        out[name + ".data"] = weight.data.detach().cpu().clone()
        state = getattr(weight, "quant_state", None)
        scales = (state.absmax if state is not None
                  else weight.SCB if getattr(weight, "SCB", None) is not None
                  else module.state.SCB)
        out[name + ".scales"] = scales.detach().cpu().clone()
    return out


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


Prepared = tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, Iterable]


def prepare(model: torch.nn.Module, plugin: LazyTrainPlugin | None, setting: QloraSetting
            ) -> Prepared:
    """The user's setup: AdamW on the adapters, random token batches, `acc.prepare`."""
    steps = setting.warmup_steps + setting.timed_steps
    ids = torch.randint(0, setting.model_config["vocab_size"],
                        (setting.batch_size * steps, setting.seq_len),
                        generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids),
                                         batch_size=setting.batch_size)
    extra = {} if plugin is None else {"plugin": plugin}
    acc = Accelerator(cpu=setting.device.type == "cpu",
                      mixed_precision="no" if setting.compute_dtype is None else "bf16", **extra)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return acc, *acc.prepare(model, optimizer, loader)


def run_steps(prepared: Prepared, setting: QloraSetting) -> tuple[list[float], list[float]]:
    """The user's loop (clip, step, zero_grad); the losses, and the timed steps' seconds
    (start of one step to the start of the next)."""
    acc, model, optimizer, loader = prepared
    losses, starts = [], []
    for (batch,) in loader:
        _sync(setting.device)
        starts.append(time.perf_counter())
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    _sync(setting.device)
    starts.append(time.perf_counter())
    acc.wait_for_everyone()
    times = [b - a for a, b in itertools.pairwise(starts)]
    return losses, times[setting.warmup_steps:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _plugin(setting: QloraSetting, work: Path, fmt: str) -> LazyTrainPlugin:
    """Planned on the check's measured profile, which `run_phase` saves beside `work`:
    `hardware="auto"` measured this machine again for this phase's own NVMe directory (a
    third of the dry run)."""
    frozen = fmt.removeprefix(PREPARE) if fmt.startswith(PREPARE) else "keep"
    return LazyTrainPlugin(plan="auto", hardware=str(work.parent / HARDWARE_JSON),
                           optimizer="keep",
                           gpu_memory_limit_gb=setting.gpu_memory_limit_gb,
                           solver_time_limit_s=10, nvme_dir=str(work / "nvme"),
                           emulate_async=setting.emulate_async or None, frozen_weights=frozen)


def _stock_run(fmt: str, setting: QloraSetting, base: Path
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float],
                          list[float]]:
    """Stock Accelerate on a fresh load: the packed weights it trains (as loaded and after
    training: bitsandbytes repacks them for its CPU kernel in eval mode), losses, times."""
    model = load_qlora(base, fmt, setting)
    if fmt.startswith(PREPARE):  # what the plugin's frozen_weights does, done by hand
        quantize_frozen_linears(model, fmt.removeprefix(PREPARE), _dtype(setting))
    loaded = packed_snapshot(model)
    prepared = prepare(model, None, setting)
    losses, times = run_steps(prepared, setting)
    trained = packed_snapshot(model)
    prepared[0].end_training()
    del model, prepared
    _free_device(setting.device)
    return loaded, trained, losses, times


def _free_device(device: torch.device) -> int:
    """Collect the runs' cycles (accelerator <-> engine) and return cached device blocks,
    so the next run (and the 3B phase's caps and peaks) start clean; bytes still held."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def check_format(fmt: str, setting: QloraSetting, base: Path) -> QloraResult:
    """Stock Accelerate, then the plugin, each on a fresh load of `base` in `fmt`."""
    start = time.perf_counter()
    loaded, stock_trained, stock_losses, stock_times = _stock_run(fmt, setting, base)
    prepared = prepare(load_qlora(base, fmt, setting), _plugin(setting, base, fmt), setting)
    acc, model = prepared[0], prepared[1]
    fresh = packed_snapshot(model)  # on the host now (or quantized by the plugin)
    losses, times = run_steps(prepared, setting)
    run, engine = acc.lazytrain.run, acc.lazytrain.engine
    predicted = simulate(run.plan, run.model_profile, run.hardware, include_optimizer=True)
    as_stock = _identical(packed_snapshot(model), stock_trained)
    acc.end_training()
    worst = max(abs(a - b) / max(abs(b), 1e-6)
                for a, b in zip(losses, stock_losses, strict=True))
    step_s = statistics.median(times)
    identical = _identical(loaded, fresh)
    return QloraResult(
        fmt=fmt, packed_tensors=len(fresh) // 2,
        packed_bytes=sum(t.numel() * t.element_size() for t in fresh.values()),
        stock_losses=stock_losses, losses=losses, max_rel_loss_diff=worst,
        prepared_identical=identical, packed_as_stock=as_stock,
        stock_step_s=statistics.median(stock_times), step_s=step_s,
        predicted_step_s=predicted.step_s, step_ratio=step_s / predicted.step_s,
        homes=run.plan.count_homes(), streams=type(engine.streams).__name__,
        pool=type(engine.pool).__name__,
        passed=worst <= BF16_REL_TOL and as_stock and identical and len(fresh) > 0,
        wall_s=time.perf_counter() - start)


def dequant_rates(setting: QloraSetting, hardware: HardwareProfile) -> dict:
    """The measured nf4 dequantization rate (one square matrix per `dequant_sides`: the
    hardware profile's own probe is 2048) beside the preset's estimate (the preset whose
    GPU name matches the profile's, else h200) and the profile's figure."""
    name = next((p.name for p in HARDWARE_PRESETS.values() if p.gpu_name == hardware.gpu_name),
                "h200")
    preset = HARDWARE_PRESETS[name].dequant_bytes_per_s
    measured = []
    for side in setting.dequant_sides:
        rate, how = _measure_dequant(setting.device, side=side)
        measured.append({"side": side, "bytes_per_s": rate, "over_preset": rate / preset,
                         "how": how})
    return {"preset": name, "preset_bytes_per_s": preset,
            "profile_bytes_per_s": hardware.dequant_bytes_per_s, "measured": measured}


def peft_missing() -> str | None:
    """Why the formats cannot run (peft, a test-only dependency of the package, is not
    importable), or None when they can."""
    try:
        import peft  # noqa: F401
    except ImportError as err:
        return (f"QLoRA formats skipped: peft is not importable ({err}); put its wheel in "
                f".whl/ (the download command in bench/gpu_check.sh) or pip install peft")
    return None


def run_phase(setting: QloraSetting, hardware: HardwareProfile,
              formats: tuple[str, ...] = FORMATS) -> dict:
    """The phase's report: the dequant rates, then one result per format (a format that
    raises is reported with its error; the others still run). Without peft the formats
    are skipped, and `report["skipped"]` says why."""
    report: dict = {"dequant": dequant_rates(setting, hardware), "results": [],
                    "errors": []}
    report["skipped"] = peft_missing()
    if report["skipped"] is not None:
        return report
    with tempfile.TemporaryDirectory(prefix="lazytrain_qlora_") as work:
        base = Path(work) / "base"
        hardware.save(Path(work) / HARDWARE_JSON)
        if _attempt(report, "base", lambda: save_base(setting, base)):
            for fmt in formats:
                _attempt(report, fmt, lambda fmt=fmt: report["results"].append(
                    asdict(check_format(fmt, setting, base))))
                report["device_bytes_left"] = _free_device(setting.device)
    return report


def _attempt(report: dict, name: str, fn: Callable[[], object]) -> bool:
    """Run `fn`; an exception is listed in `report["errors"]` (the check then fails)."""
    try:
        fn()
    except Exception as err:
        report["errors"].append({"fmt": name, "error": f"{type(err).__name__}: {err}"})
        return False
    return True


def passed(report: dict) -> bool:
    """No format failed (formats skipped for want of peft fail nothing: the report and
    the table say they were skipped)."""
    return not report["errors"] and all(r["passed"] for r in report["results"])


def format_table(report: dict) -> str:
    d = report["dequant"]
    rows = [f"dequant nf4, preset {d['preset']}: {d['preset_bytes_per_s'] / 1e9:.1f} GB/s "
            f"(estimate), profile: {d['profile_bytes_per_s'] / 1e9:.1f} GB/s"]
    rows += [f"  measured {m['side']}x{m['side']}: {m['bytes_per_s'] / 1e9:.1f} GB/s "
             f"({m['over_preset']:.2f} x preset; {m['how']})" for m in d["measured"]]
    if report["skipped"] is not None:
        return "\n".join([*rows, report["skipped"]])
    rows.append(f"{'format':<12}{'packed MB':>10}{'max rel loss diff':>19}{'as stock':>10}"
                f"{'stock s':>9}{'step s':>9}{'pred s':>9}{'ratio':>7}{'ok':>5}")
    for r in report["results"]:
        rows.append(f"{r['fmt']:<12}{r['packed_bytes'] / 1e6:>10.1f}"
                    f"{r['max_rel_loss_diff']:>19.2e}"
                    f"{'yes' if r['packed_as_stock'] else 'NO':>10}"
                    f"{r['stock_step_s']:>9.3f}{r['step_s']:>9.3f}{r['predicted_step_s']:>9.3f}"
                    f"{r['step_ratio']:>7.2f}{'yes' if r['passed'] else 'NO':>5}")
    rows += [f"{e['fmt']:<12}ERROR {e['error']}" for e in report["errors"]]
    return "\n".join(rows)
