"""Drawing a simulated step: a Chrome trace (chrome://tracing, Perfetto) and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lazytrain_accel.planning.simulate import SimulationResult

RESOURCES = ("compute", "h2d", "d2h", "nvme_read", "nvme_write")


def chrome_trace(result: SimulationResult) -> dict[str, Any]:
    """Trace Event Format: one thread per resource, times in microseconds, plus one
    counter track per memory tier."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": res}}
        for tid, res in enumerate(RESOURCES)]
    for op in result.ops:
        events.append({"ph": "X", "name": op.name, "cat": op.resource, "pid": 0,
                       "tid": RESOURCES.index(op.resource), "ts": op.start_s * 1e6,
                       "dur": op.duration_s * 1e6, "args": {"window": op.window}})
    for tier, curve in result.memory_bytes.items():
        events += [{"ph": "C", "name": f"{tier}_bytes", "pid": 0, "ts": t * 1e6,
                    "args": {"bytes": nbytes}} for t, nbytes in curve]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(result)))


def draw_timeline(result: SimulationResult, path: str | Path) -> None:
    """Gantt chart of the resources above GPU memory over time, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, (gantt, memory) = plt.subplots(2, 1, figsize=(14, 6), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 2]})
    colors = {"F": "tab:blue", "B": "tab:orange", "R": "tab:red", "h": "tab:purple"}
    for row, res in enumerate(RESOURCES):
        spans = [(op.start_s, op.duration_s, colors.get(op.name[0], "tab:gray"))
                 for op in result.ops if op.resource == res]
        gantt.broken_barh([(s, d) for s, d, _ in spans], (row - 0.4, 0.8),
                          facecolors=[c for _, _, c in spans], linewidth=0)
    gantt.set_yticks(range(len(RESOURCES)), RESOURCES)
    gantt.invert_yaxis()
    gantt.set_title(f"step {result.step_s:.3f} s, exposed {result.exposed_s:.3f} s, "
                    f"recompute {result.recompute_s:.3f} s")
    for tier, curve in result.memory_bytes.items():
        if len(curve) > 1:
            memory.step([t for t, _ in curve], [b / 2**30 for _, b in curve], where="post",
                        label=tier)
    memory.set_ylabel("GiB")
    memory.set_xlabel("seconds")
    memory.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
