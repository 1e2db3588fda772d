"""Drawing a simulated step: a Chrome trace (chrome://tracing, Perfetto) and a PNG.

The PNG has one lane per resource the step used (compute, the copy links, the host
optimizer), bars coloured by what they move or compute (with a legend), a faint line at
the start of every layer window, and below it one memory panel per tier in its own unit
(MiB or GiB), with the tier's budget when one is given (docs/reading_a_plan.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lazytrain_accel.planning.events import SimOp
from lazytrain_accel.planning.problem import Budgets
from lazytrain_accel.planning.simulate import SimulationResult, is_optimizer_lane

#: Lanes in drawing order; resources outside this list get lanes after these.
RESOURCES = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "device_optimizer",
             "host_optimizer")
#: Colour and legend label of each kind of op, in legend order.
CATEGORIES: dict[str, tuple[str, str]] = {
    "forward": ("tab:blue", "forward"),
    "backward": ("tab:orange", "backward"),
    "recompute": ("tab:red", "recompute (forward again)"),
    "head": ("tab:purple", "head + loss"),
    "weights": ("tab:gray", "layer weights H2D"),
    "grads": ("tab:brown", "gradients D2H"),
    "activations": ("tab:cyan", "activation offload / reload"),
    "optimizer": ("tab:green", "optimizer update"),
    "other": ("black", "other"),
}
#: A bar is drawn at least this fraction of the step wide, so short copies stay visible.
MIN_BAR_FRACTION = 0.002
_TIERS = (("gpu", "GPU memory"), ("cpu", "host memory"), ("nvme", "NVMe"))
_MIB, _GIB = 2**20, 2**30


def chrome_trace(result: SimulationResult) -> dict[str, Any]:
    """Trace Event Format: one thread per resource, times in microseconds, plus one
    counter track per memory tier."""
    lanes = lanes_of(result.ops)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": res}}
        for tid, res in enumerate(lanes)]
    for op in result.ops:
        events.append({"ph": "X", "name": op.name, "cat": op.resource, "pid": 0,
                       "tid": lanes.index(op.resource), "ts": op.start_s * 1e6,
                       "dur": op.duration_s * 1e6, "args": {"window": op.window}})
    for tier, curve in result.memory_bytes.items():
        events += [{"ph": "C", "name": f"{tier}_bytes", "pid": 0, "ts": t * 1e6,
                    "args": {"bytes": nbytes}} for t, nbytes in curve]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(result)))


def lanes_of(ops: list[SimOp]) -> list[str]:
    """Every resource present in `ops`: the known ones in `RESOURCES` order, then others."""
    present = {op.resource for op in ops}
    return [r for r in RESOURCES if r in present] + sorted(present - set(RESOURCES))


def category(op: SimOp) -> str:
    """What an op does, from the simulator's names (F3, B3, R3, head, W3, RW3, G3,
    G_resident, "d2h:3" for boundary 3) and its resource."""
    if is_optimizer_lane(op.resource):
        return "optimizer"
    if ":" in op.name:
        return "activations"
    if op.name == "head":
        return "head"
    prefix = op.name.rstrip("0123456789")
    return {"F": "forward", "B": "backward", "R": "recompute", "W": "weights",
            "RW": "weights", "G": "grads", "G_resident": "grads"}.get(prefix, "other")


def window_starts_s(ops: list[SimOp]) -> list[float]:
    """When each layer window's compute starts, in window order."""
    starts: dict[int, float] = {}
    for op in ops:
        if op.resource == "compute" and op.window >= 0:
            starts[op.window] = min(op.start_s, starts.get(op.window, op.start_s))
    return [starts[w] for w in sorted(starts)]


def _seconds(value_s: float) -> str:
    """3.42 s, 12.5 ms, 18 us: a duration in the unit it reads in."""
    if value_s == 0 or value_s >= 1:
        return f"{value_s:.2f} s"
    if value_s >= 1e-3:
        return f"{value_s * 1e3:.3g} ms"
    return f"{value_s * 1e6:.3g} us"


def _amount(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def byte_unit(largest_bytes: float) -> tuple[str, int]:
    """MiB below 1 GiB, else GiB: a small model's curve reads in MiB."""
    return ("GiB", _GIB) if largest_bytes >= _GIB else ("MiB", _MIB)


def draw_timeline(result: SimulationResult, path: str | Path, *,
                  budgets: Budgets | None = None) -> None:
    """`timeline_figure` saved as PNG."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(result, budgets=budgets)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_figure(result: SimulationResult, *, budgets: Budgets | None = None) -> Any:
    """Lanes of the step's ops above one memory panel per tier in use (NVMe only when the
    step puts bytes there): a matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    lanes = lanes_of(result.ops)
    tiers = [(t, label) for t, label in _TIERS
             if t != "nvme" or max((b for _, b in result.memory_bytes.get(t, [])), default=0)]
    heights = [0.5 * len(lanes) + 0.6, *[1.6] * len(tiers)]
    fig, axes = plt.subplots(len(heights), 1, figsize=(14, sum(heights) + 0.8), sharex=True,
                             gridspec_kw={"height_ratios": heights})
    _draw_lanes(axes[0], result, lanes)
    for ax, (tier, label) in zip(axes[1:], tiers, strict=True):
        budget = None if budgets is None else getattr(budgets, f"{tier}_bytes")
        _draw_memory(ax, result.memory_bytes.get(tier, []), result.step_s, label, budget)
    axes[-1].set_xlabel("seconds into the step")
    axes[-1].set_xlim(0, result.step_s * 1.01)
    fig.tight_layout()
    return fig


def _draw_lanes(ax: Any, result: SimulationResult, lanes: list[str]) -> None:
    min_width_s = result.step_s * MIN_BAR_FRACTION
    used: set[str] = set()
    for row, resource in enumerate(lanes):
        ops = [op for op in result.ops if op.resource == resource]
        kinds = [category(op) for op in ops]
        used.update(kinds)
        ax.broken_barh([(op.start_s, max(op.duration_s, min_width_s)) for op in ops],
                       (row - 0.4, 0.8), facecolors=[CATEGORIES[k][0] for k in kinds],
                       edgecolor="white", linewidth=0.3)
    for start_s in window_starts_s(result.ops)[1:]:
        ax.axvline(start_s, color="black", alpha=0.15, linewidth=0.6, zorder=0)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    title = (f"predicted step {_seconds(result.step_s)}: compute "
             f"{_seconds(result.compute_s)}, recompute {_seconds(result.recompute_s)}, "
             f"exposed transfers {_seconds(result.exposed_s - result.optimizer_exposed_s)}")
    if result.optimizer_exposed_s > 0:
        title += f", exposed optimizer {_seconds(result.optimizer_exposed_s)}"
    ax.set_title(title + "  (faint lines: layer windows)", fontsize=10, loc="left")
    handles = [_patch(CATEGORIES[k]) for k in CATEGORIES if k in used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)


def _patch(color_label: tuple[str, str]) -> Any:
    from matplotlib.patches import Patch

    color, label = color_label
    return Patch(facecolor=color, label=label)


def _draw_memory(ax: Any, curve: list[tuple[float, int]], step_s: float, label: str,
                 budget_bytes: int | None) -> None:
    """One tier's bytes over the step, drawn to its end, in the unit its peak reads in."""
    points = list(curve) or [(0.0, 0)]
    points.append((step_s, points[-1][1]))  # the level holds to the end of the step
    peak = max(b for _, b in points)
    shown_budget = budget_bytes is not None and 0 < budget_bytes <= 4 * max(peak, 1)
    unit, scale = byte_unit(max(peak, budget_bytes if shown_budget else 0))
    ax.step([t for t, _ in points], [b / scale for _, b in points], where="post",
            color="tab:blue", linewidth=1.2, label=f"{label} (peak {_amount(peak / scale)} {unit})")
    if shown_budget:
        ax.axhline(budget_bytes / scale, color="tab:red", linestyle="--", linewidth=1,
                   label=f"budget {_amount(budget_bytes / scale)} {unit}")
    elif budget_bytes:
        b_unit, b_scale = byte_unit(budget_bytes)
        ax.plot([], [], " ",
                label=f"budget {_amount(budget_bytes / b_scale)} {b_unit} (off the axis)")
    ax.set_ylim(0, max(peak, budget_bytes if shown_budget else 0) / scale * 1.15 or 1)
    ax.set_ylabel(unit)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
