"""The demo's training loop: plain Accelerate code, with LazyTrain under `prepare`."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.profiler import ProfilerActivity, profile

from lazytrain_accel.engine.step.fidelity import FidelityMonitor
from lazytrain_accel.progress import PlainProgress
from lazytrain_accel.run.replanner import current_prediction, predicted_step_s

if TYPE_CHECKING:
    from lazytrain_accel.frontends.accelerate import Accelerator


@dataclass(kw_only=True)
class TrainResult:
    steps: int
    final_loss: float
    mean_step_s: float  # excludes the first and the traced step
    median_step_s: float  # of the same steps
    tokens_per_s: float
    stall_s: float  # engine wait on transfers and updates, summed over all steps


def _forever(loader: Any) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


def _trace_context(trace_path: Path | None) -> Any:
    """torch.profiler around one step when a trace is wanted, else a no-op context."""
    if trace_path is None:
        return contextlib.nullcontext()
    # Kineto prints "USDT: ... profiler_start/stop" on stderr at its default level; 6 is
    # above all of its levels. A level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, record_shapes=False)


def _optimizer_step(accelerator: Accelerator, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any,
                    batch: dict[str, torch.Tensor], *, max_grad_norm: float) -> float:
    """One step of plain Accelerate code; the loss as a float."""
    loss = model(**batch).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@contextlib.contextmanager
def _progress_bar(console: Console, steps: int, *, enabled: bool) -> Iterator[Any]:
    """Yields `update(info)`, advancing a rich bar by one step (a no-op when disabled)."""
    if not enabled:
        yield lambda info: None
        return
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=steps, info="")
        yield lambda info: progress.update(task, advance=1, info=info)


def train(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: Any, loader: Any, *, steps: int, max_grad_norm: float,
          console: Console, trace_path: Path | None) -> TrainResult:
    """`steps` optimizer steps; the step chosen for tracing (the second, once caches are
    warm) is recorded with torch.profiler and written to `trace_path` as a Chrome trace."""
    engine = accelerator.lazytrain.engine
    batches = _forever(loader)
    traced_step = min(1, steps - 1)
    step_times_s, loss_value, stall_s, tokens = [], float("nan"), 0.0, 0
    # A bar on a terminal; in a log (not a terminal) a plain line every few steps.
    plain = None if console.is_terminal else PlainProgress(total_steps=steps)
    model.train()
    fidelity = FidelityMonitor(interval_steps=max(steps // 5, 1))  # engine/step/fidelity.py
    with _progress_bar(console, steps, enabled=plain is None) as update:
        for step in range(steps):
            batch = next(batches)
            engine.reset_stats()
            start = time.perf_counter()
            tracing = trace_path if step == traced_step else None
            with _trace_context(tracing) as prof:
                loss_value = _optimizer_step(accelerator, model, optimizer, scheduler, batch,
                                             max_grad_norm=max_grad_norm)
            step_s = time.perf_counter() - start
            if tracing is not None:
                prof.export_chrome_trace(str(tracing))
            step_times_s.append(step_s)
            step_stall_s = engine.stats().stall_s
            stall_s += step_stall_s
            fidelity.add_step(current_prediction(accelerator.lazytrain.replanner, engine.plan),
                              step_s, engine.stats(), console.log)
            tokens = batch["input_ids"].numel()
            update(f"loss {loss_value:.3f}  {tokens / step_s:,.0f} tok/s  "
                   f"stall {step_stall_s * 1e3:.1f} ms")
            line = plain and plain.step_done(
                step + 1, step_s=step_s, stall_s=step_stall_s, tokens=tokens, loss=loss_value,
                predicted_step_s=predicted_step_s(accelerator.lazytrain.replanner,
                                                  engine.plan))
            if line:
                console.print(line, highlight=False, markup=False)
    # The first step fills caches and the traced one pays the profiler: neither is typical.
    timed = [t for i, t in enumerate(step_times_s) if i not in (0, traced_step)] or step_times_s
    mean_step_s = sum(timed) / len(timed)
    return TrainResult(steps=steps, final_loss=loss_value, mean_step_s=mean_step_s,
                       median_step_s=statistics.median(timed),
                       tokens_per_s=tokens / mean_step_s, stall_s=stall_s)
