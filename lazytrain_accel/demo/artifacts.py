"""What the demo leaves in `--output-dir`, besides the measured-step trace train.py writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.utils import logging as hf_logging

from lazytrain_accel.checkpoints.atomic import make_readable
from lazytrain_accel.data.arithmetic import write_jsonl
from lazytrain_accel.planning import Budgets, simulate
from lazytrain_accel.planning.timeline import draw_timeline, save_chrome_trace
from lazytrain_accel.run.setup import PreparedRun

#: File names inside the output directory; tests and docs refer to these.
CHECKPOINT_DIR = "checkpoint"
EVAL_PROBLEMS_FILE = "eval_problems.jsonl"
PLAN_FILE = "plan.json"
TIMELINE_FILE = "timeline.png"
PREDICTED_TRACE_FILE = "trace_predicted_step.json"
MEASURED_TRACE_FILE = "trace_measured_step.json"


def write_artifacts(out: Path, *, model: Any, tokenizer: Any, run: PreparedRun,
                    budgets: Budgets, eval_records: list[dict[str, str]]) -> dict[str, str]:
    """HF checkpoint (safetensors + tokenizer), the held-out problems exact match was
    measured on, plan JSON, predicted timeline PNG and Chrome trace; returns
    {what: path} of every file the demo produced."""
    checkpoint = out / CHECKPOINT_DIR
    hf_logging.disable_progress_bar()  # "Writing model shards" for one small file
    try:
        model.save_pretrained(checkpoint, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(checkpoint)
    make_readable(checkpoint)  # transformers leaves model.safetensors 0600
    write_jsonl(eval_records, out / EVAL_PROBLEMS_FILE)
    run.plan.save(out / PLAN_FILE)
    # With the host optimizer: the demo's update runs on the CPU, layer by layer.
    simulated = simulate(run.plan, run.model_profile, run.hardware, include_optimizer=True)
    draw_timeline(simulated, out / TIMELINE_FILE, budgets=budgets)
    save_chrome_trace(simulated, out / PREDICTED_TRACE_FILE)
    return {"checkpoint": str(checkpoint), "eval_problems": str(out / EVAL_PROBLEMS_FILE),
            "plan": str(out / PLAN_FILE), "timeline": str(out / TIMELINE_FILE),
            "predicted_trace": str(out / PREDICTED_TRACE_FILE),
            "measured_trace": str(out / MEASURED_TRACE_FILE)}
