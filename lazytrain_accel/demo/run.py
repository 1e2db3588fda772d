"""`run_demo`: profile, plan, stream, step, evaluate and save, on this machine, no downloads."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from torch.utils.data import DataLoader

from lazytrain_accel.data.arithmetic import (
    bundled_path,
    extract_answer,
    load_jsonl,
    split_train_eval,
)
from lazytrain_accel.data.collate import CausalLMCollator, encode_records
from lazytrain_accel.data.evaluate import EvalResult, Sample, exact_match
from lazytrain_accel.demo.artifacts import MEASURED_TRACE_FILE, write_artifacts
from lazytrain_accel.demo.budget import demo_gpu_budget_gb
from lazytrain_accel.demo.model import load_model_and_tokenizer
from lazytrain_accel.demo.report import hardware_table, model_table, plan_columns, plan_table
from lazytrain_accel.demo.train import TrainResult, train
from lazytrain_accel.planning import Budgets
from lazytrain_accel.threads import apply_threads

if TYPE_CHECKING:
    from lazytrain_accel.frontends.accelerate import Accelerator

SUMMARY_FILE = "demo_summary.json"
#: The one default output directory (README, docs, .gitignore).
DEFAULT_OUTPUT_DIR = "lazytrain_output"


@dataclass(kw_only=True)
class DemoSettings:
    """What `lazytrain demo` runs; the defaults are the measured demo (README).

    `plan`, `hardware`, `nvme_dir`, `gpu_memory_gb` and `loss_chunk_tokens` left at None
    are `LazyTrainPlugin` fields the plugin fills from `LAZYTRAIN_*` variables, then from
    its defaults (an unset `gpu_memory_gb` is the demo budget of budget.py).
    """

    model: str | None = None  # local HF directory; None = the built-in demo model
    dataset: str | None = None  # MetaMathQA-form JSONL; None = the bundled problems
    steps: int = 300
    batch_size: int = 32
    seq_len: int = 48
    lr: float = 3e-3
    output_dir: str = DEFAULT_OUTPUT_DIR
    plan: str | None = None
    hardware: str | None = None
    nvme_dir: str | None = None
    gpu_memory_gb: float | None = None  # 0 = the whole device
    eval_count: int = 200
    max_new_tokens: int = 32
    seed: int = 0
    max_grad_norm: float = 1.0
    loss_chunk_tokens: int | str | None = None  # > 0: the fused chunked loss; "auto": the plan's

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_count", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")


@dataclass(kw_only=True)
class DemoResult:
    exact_match_before: float
    exact_match_after: float
    eval_problems: int
    max_new_tokens: int  # of the greedy generation that exact match was measured with
    samples_after: list[Sample]  # labelled right and wrong answers after training
    train: TrainResult
    wall_s: float
    files: dict[str, str] = field(default_factory=dict)


def _load_records(settings: DemoSettings) -> tuple[list[dict], list[dict]]:
    records = load_jsonl(settings.dataset or bundled_path())
    return split_train_eval(records, eval_count=min(settings.eval_count, len(records) // 4))


def _make_loader(tokenizer: Any, records: list[dict], settings: DemoSettings) -> DataLoader:
    examples = encode_records(tokenizer, records, seq_len=settings.seq_len)
    if len(examples) < settings.batch_size:
        raise ValueError(f"--batch-size {settings.batch_size} exceeds the {len(examples)} "
                         "training records; lower it or pass a larger --dataset")
    collator = CausalLMCollator(pad_token_id=tokenizer.pad_token_id, seq_len=settings.seq_len)
    return DataLoader(examples, batch_size=settings.batch_size, shuffle=True, drop_last=True,
                      collate_fn=collator,
                      generator=torch.Generator().manual_seed(settings.seed))


def _accelerator(settings: DemoSettings, model: torch.nn.Module) -> Any:
    from lazytrain_accel import Accelerator, LazyTrainPlugin
    from lazytrain_accel.profiling.hardware_spec import load_hardware
    from lazytrain_accel.run.setup import compute_dtype_for, profile_for_run

    mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    # Settings left unset stay None: the plugin reads LAZYTRAIN_* for them, then defaults.
    plugin = LazyTrainPlugin(plan=settings.plan, hardware=settings.hardware,
                             nvme_dir=settings.nvme_dir,
                             gpu_memory_limit_gb=settings.gpu_memory_gb,
                             loss_chunk_tokens=settings.loss_chunk_tokens)
    # Before the hardware is measured: the compute rate depends on the thread count.
    apply_threads(plugin.threads, device=torch.device("cuda" if torch.cuda.is_available()
                                                      else "cpu"))
    if plugin.is_default("gpu_memory_limit_gb"):
        profile = profile_for_run(model, batch_size=settings.batch_size,
                                  seq_len=settings.seq_len,
                                  compute_dtype=compute_dtype_for(mixed),
                                  loss_chunk_tokens=plugin.loss_chunk_tokens)
        hardware = load_hardware(plugin.hardware, cache_dir=plugin.cache_dir,
                                 nvme_dir=plugin.nvme_dir)
        plugin.gpu_memory_limit_gb = demo_gpu_budget_gb(profile, hardware)
    return Accelerator(mixed_precision=mixed, plugin=plugin)


def _schedule(optimizer: torch.optim.Optimizer, steps: int) -> Any:
    """Linear warm-up over 5% of the steps, then linear decay to a tenth."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * max(0.1, 1.0 - step / steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _evaluate(label: str, accelerator: Accelerator, model: Any, tokenizer: Any, records: list[dict],
              settings: DemoSettings, console: Console, *, shown: int) -> EvalResult:
    start = time.perf_counter()
    result = exact_match(model, tokenizer, records, device=accelerator.device,
                         max_new_tokens=settings.max_new_tokens, keep_samples=shown)
    console.print(f"exact match {label}: [bold]{result.exact_match:.1%}[/bold] "
                  f"({result.correct}/{result.total}, {time.perf_counter() - start:.1f} s)")
    for sample in result.samples:
        stated = extract_answer(sample.generated)
        verdict = "right" if sample.correct else (
            f"wrong (says {stated})" if stated is not None else "wrong (no answer)")
        console.print(f"  [{verdict}, expected {sample.expected}] Q: {sample.query}\n"
                      f"    A: {sample.generated.strip()!r}", highlight=False, markup=False)
    return result


#: How `run.setup.format_plan_summary` starts (tests/demo check it is dropped).
PLAN_SUMMARY_PREFIX = "LazyTrain plan "


class _DropPlanSummary(logging.Filter):
    """`prepare` logs the plan as a text block; the demo prints it as tables instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(PLAN_SUMMARY_PREFIX)


@contextlib.contextmanager
def _plan_printed_once() -> Iterator[None]:
    log, drop = logging.getLogger("lazytrain_accel"), _DropPlanSummary()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def run_demo(settings: DemoSettings, console: Console | None = None) -> DemoResult:
    """Fine-tune, evaluate before/after, write the artifacts; see docs/getting_started.md."""
    console = console or Console()
    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    train_records, eval_records = _load_records(settings)
    texts = [r["query"] + "\n" + r["response"] for r in train_records]
    model, tokenizer = load_model_and_tokenizer(settings.model, texts, seed=settings.seed)
    loader = _make_loader(tokenizer, train_records, settings)
    accelerator = _accelerator(settings, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    with _plan_printed_once():
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # Built on the prepared optimizer (LazyTrain swapped in its own), so the scheduler
    # counts the steps that really happen.
    scheduler = _schedule(optimizer, settings.steps)
    run = accelerator.lazytrain.run
    plugin = accelerator.lazytrain_plugin
    budgets = Budgets.from_hardware(  # 0 GiB means the whole tier
        run.hardware, gpu_memory_limit_gb=plugin.gpu_memory_limit_gb,
        cpu_memory_limit_gb=plugin.cpu_memory_limit_gb, nvme_limit_gb=plugin.nvme_limit_gb)
    columns = plan_columns(run, plugin)
    for table in (hardware_table(run.hardware, gpu_budget_bytes=budgets.gpu_bytes),
                  model_table(run.model_profile), plan_table(columns)):
        console.print(table)
    before = _evaluate("before training", accelerator, model, tokenizer, eval_records,
                       settings, console, shown=1)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trained = train(accelerator, model, optimizer, scheduler, loader, steps=settings.steps,
                    max_grad_norm=settings.max_grad_norm, console=console,
                    trace_path=out / MEASURED_TRACE_FILE)
    after = _evaluate("after training", accelerator, model, tokenizer, eval_records,
                      settings, console, shown=2)
    accelerator.end_training()  # detaches the engine: the model is a plain HF model again
    files = write_artifacts(out, model=model, tokenizer=tokenizer, run=run, budgets=budgets,
                            eval_records=eval_records)
    result = DemoResult(exact_match_before=before.exact_match,
                        exact_match_after=after.exact_match, eval_problems=after.total,
                        max_new_tokens=settings.max_new_tokens, samples_after=after.samples,
                        train=trained, wall_s=time.perf_counter() - start, files=files)
    (out / SUMMARY_FILE).write_text(json.dumps(asdict(result), indent=1))
    return result
