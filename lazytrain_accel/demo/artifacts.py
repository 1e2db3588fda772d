"""What the demo leaves in `--output-dir`, besides the measured-step trace train.py writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lazytrain_accel.integrations.setup import PreparedRun
from lazytrain_accel.planning import simulate
from lazytrain_accel.planning.timeline import RESOURCES, draw_timeline, save_chrome_trace

#: File names inside the output directory; tests and docs refer to these.
CHECKPOINT_DIR = "checkpoint"
PLAN_FILE = "plan.json"
TIMELINE_FILE = "timeline.png"
PREDICTED_TRACE_FILE = "trace_predicted_step.json"
MEASURED_TRACE_FILE = "trace_measured_step.json"


def write_artifacts(out: Path, *, model: Any, tokenizer: Any, run: PreparedRun) -> dict[str, str]:
    """HF checkpoint (safetensors + tokenizer), plan JSON, predicted timeline PNG and
    Chrome trace; returns {what: path} of every file the demo produced."""
    checkpoint = out / CHECKPOINT_DIR
    model.save_pretrained(checkpoint, safe_serialization=True)
    tokenizer.save_pretrained(checkpoint)
    run.plan.save(out / PLAN_FILE)
    simulated = simulate(run.plan, run.model_profile, run.hardware)
    # Only the lanes the timeline draws (the host optimizer's once it has one).
    simulated = dataclasses.replace(simulated, ops=[op for op in simulated.ops
                                                    if op.resource in RESOURCES])
    draw_timeline(simulated, out / TIMELINE_FILE)
    save_chrome_trace(simulated, out / PREDICTED_TRACE_FILE)
    return {"checkpoint": str(checkpoint), "plan": str(out / PLAN_FILE),
            "timeline": str(out / TIMELINE_FILE),
            "predicted_trace": str(out / PREDICTED_TRACE_FILE),
            "measured_trace": str(out / MEASURED_TRACE_FILE)}
