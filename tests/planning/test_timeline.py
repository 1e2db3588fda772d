"""timeline.png: lanes for every resource, a legend for every colour, window lines,
visible transfers, one memory panel per tier in its own unit, budget lines."""

from __future__ import annotations

import dataclasses

import matplotlib
import pytest
from planner_chains import budgets_in_slots, chain

from lazytrain_accel.planning import make_plan, simulate
from lazytrain_accel.planning.events import SimOp
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.timeline import (
    CATEGORIES,
    MIN_BAR_FRACTION,
    category,
    chrome_trace,
    lanes_of,
    timeline_figure,
    window_starts_s,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt


@pytest.fixture(scope="module")
def step():  # a 10-layer chain with boundaries on all three tiers
    model, hardware = chain(num_layers=10, d2h_gbps=8.0, h2d_gbps=8.0)
    budgets = budgets_in_slots(model, hardware, gpu_slots=5, cpu_slots=3, nvme_slots=3)
    plan = make_plan(model, hardware, PlanRequest(budgets=budgets, gap=0.0))
    assert {"nvme_read", "nvme_write"} <= {op.resource for op in simulate(
        plan, model, hardware).ops}
    return simulate(plan, model, hardware), budgets


def _with_host_optimizer(result):
    """The result plus host-optimizer ops, as the simulator emits them for the update."""
    extra = [SimOp(name=f"U{j}", resource="host_optimizer", duration_s=result.step_s / 20,
                   start_s=result.step_s * j / 10, end_s=result.step_s * (j / 10 + 0.05))
             for j in range(1, 7)]
    return dataclasses.replace(result, ops=[*result.ops, *extra])


def test_a_lane_per_resource_present_in_the_known_order(step) -> None:
    result, _ = step
    ops = [*_with_host_optimizer(result).ops,
           SimOp(name="x", resource="pcie_peer", duration_s=0.0)]
    assert lanes_of(ops) == ["compute", "h2d", "d2h", "nvme_read", "nvme_write",
                             "device_optimizer", "host_optimizer", "pcie_peer"]
    assert lanes_of([op for op in result.ops if op.resource != "nvme_read"])[2:4] == [
        "d2h", "nvme_write"]
    trace = chrome_trace(_with_host_optimizer(result))
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert threads[-1] == "host_optimizer"


def test_every_colour_drawn_has_a_legend_entry(step) -> None:
    result, budgets = step
    fig = timeline_figure(_with_host_optimizer(result), budgets=budgets)
    lanes_ax = fig.axes[0]
    labels = [t.get_text() for t in lanes_ax.get_legend().get_texts()]
    used = {category(op) for op in _with_host_optimizer(result).ops}
    assert labels == [CATEGORIES[k][1] for k in CATEGORIES if k in used]
    assert {"forward", "backward", "layer weights H2D", "activation offload / reload",
            "optimizer update"} <= set(labels)
    assert [t.get_text() for t in lanes_ax.get_yticklabels()][-1] == "host_optimizer"
    plt.close(fig)


def test_transfers_have_a_visible_width_and_windows_are_marked(step) -> None:
    result, budgets = step
    fig = timeline_figure(result, budgets=budgets)
    lanes_ax = fig.axes[0]
    widths = [w for coll in lanes_ax.collections for path in coll.get_paths()
              for w in [path.vertices[:, 0].max() - path.vertices[:, 0].min()]]
    assert min(widths) >= result.step_s * MIN_BAR_FRACTION * 0.999
    assert len(lanes_ax.lines) == len(window_starts_s(result.ops)) - 1
    plt.close(fig)


def test_memory_panels_per_tier_in_their_own_unit_to_the_end_of_the_step(step) -> None:
    result, budgets = step
    fig = timeline_figure(result, budgets=budgets)
    panels = fig.axes[1:]
    assert [ax.get_legend().get_texts()[0].get_text().split(" (")[0] for ax in panels] == [
        "GPU memory", "host memory", "NVMe"]
    for ax in panels:
        curve = ax.lines[0]
        assert curve.get_xdata()[-1] == pytest.approx(result.step_s)  # drawn to the end
        assert ax.get_ylabel() in ("MiB", "GiB")
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any(t.startswith("budget ") for t in texts)
    plt.close(fig)


def test_units_scale_and_a_far_budget_is_named_not_drawn(step) -> None:
    result, budgets = step
    small = dataclasses.replace(result, memory_bytes={"gpu": [(0.0, 5 * 2**20)],
                                                      "cpu": [(0.0, 3 * 2**30)]})
    far = dataclasses.replace(budgets, gpu_bytes=80 * 2**30)
    fig = timeline_figure(small, budgets=far)
    gpu, host = fig.axes[1], fig.axes[2]
    assert (gpu.get_ylabel(), host.get_ylabel()) == ("MiB", "GiB")
    assert len(fig.axes) == 3  # no NVMe panel when the step puts nothing there
    assert [t.get_text() for t in gpu.get_legend().get_texts()] == [
        "GPU memory (peak 5 MiB)", "budget 80 GiB (off the axis)"]
    plt.close(fig)
