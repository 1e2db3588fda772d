"""The demo's printed tables: the machine, the model at the run's shape, and the plan next
to the MegaTrain baseline's prediction on the same profiles and budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.table import Table

from lazytrain_accel.config import LazyTrainConfig
from lazytrain_accel.planning import (
    Budgets,
    Plan,
    PlanInfeasibleError,
    SimulationResult,
    make_plan,
    simulate,
)
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.profile import ModelProfile
from lazytrain_accel.run.setup import PreparedRun
from lazytrain_accel.threads import usable_cores

_MIB = 2**20
_GIB = 2**30


@dataclass(kw_only=True)
class PlanColumn:
    """One strategy's column: its plan and simulated step, or why it has none."""

    name: str
    plan: Plan | None
    simulated: SimulationResult | None
    infeasible_reason: str = ""


#: The baseline printed beside the run's plan (DESIGN.md: checkpoints every 4 layers on GPU).
BASELINE = "megatrain"


def plan_columns(run: PreparedRun, config: LazyTrainConfig) -> list[PlanColumn]:
    """The run's plan and the baseline's, planned on the same profiles and budgets, each
    run through the event simulator so both columns are predicted the same way."""
    columns = [PlanColumn(name=f"{run.plan.strategy} (this run)", plan=run.plan,
                          simulated=simulate(run.plan, run.model_profile, run.hardware))]
    if run.plan.strategy == BASELINE:
        return columns
    budgets = Budgets.from_hardware(run.hardware, gpu_memory_limit_gb=config.gpu_memory_limit_gb,
                                    cpu_memory_limit_gb=config.cpu_memory_limit_gb,
                                    nvme_limit_gb=config.nvme_limit_gb)
    try:
        baseline = make_plan(run.model_profile, run.hardware,
                             PlanRequest(strategy=BASELINE, budgets=budgets,
                                         time_limit_s=config.solver_time_limit_s))
    except PlanInfeasibleError as err:
        short = ", ".join(f"{tier} short by {n / _MIB:.1f} MiB"
                          for tier, n in err.shortfall_bytes.items())
        return [*columns, PlanColumn(name=BASELINE, plan=None, simulated=None,
                                     infeasible_reason=short or str(err))]
    simulated = simulate(baseline, run.model_profile, run.hardware)
    return [*columns, PlanColumn(name=BASELINE, plan=baseline, simulated=simulated)]


def hardware_table(hw: HardwareProfile, *, gpu_budget_bytes: int) -> Table:
    table = Table(title="Hardware", show_header=False, title_justify="left")
    for key, value in (
        ("profile", f"{hw.name}: {hw.gpu_name}"),
        ("device memory (budget)", f"{hw.gpu_memory_bytes / _GIB:.1f} GiB "
                                   f"({gpu_budget_bytes / _MIB:.1f} MiB planned)"),
        ("host memory / NVMe", f"{hw.cpu_memory_bytes / _GIB:.1f} GiB / "
                               f"{hw.nvme_bytes / _GIB:.0f} GiB"),
        # the model's own layers where prepare timed them; the peak: a preset's vendor
        # figure, or this machine's square matmul (a roofline)
        ("achieved compute / peak", f"{hw.achieved_flops_per_s / 1e12:.3f} / "
                                    f"{hw.peak_bf16_flops_per_s / 1e12:.3f} TFLOP/s"),
        ("H2D / D2H", f"{hw.h2d_bytes_per_s / 1e9:.2f} / {hw.d2h_bytes_per_s / 1e9:.2f} GB/s"),
        ("NVMe read / write", f"{hw.nvme_read_bytes_per_s / 1e9:.2f} / "
                              f"{hw.nvme_write_bytes_per_s / 1e9:.2f} GB/s"),
        ("host optimizer", f"{hw.cpu_optimizer_params_per_s / 1e6:.0f} M params/s"),
        ("torch threads", f"{torch.get_num_threads()} of {usable_cores()} cores "
                          "(LAZYTRAIN_THREADS)"),
    ):
        table.add_row(key, value)
    return table


def model_table(model: ModelProfile) -> Table:
    g = model.geometry
    table = Table(title="Model profile", show_header=False, title_justify="left")
    for key, value in (
        ("model", f"{g.name or g.family} ({g.family}), {g.total_param_count / 1e6:.2f} M params"),
        ("layers x hidden", f"{g.num_layers} x {g.hidden_size} (MLP {g.intermediate_size})"),
        ("batch x seq", f"{model.batch_size} x {model.seq_len} "
                        f"({model.compute_bytes_per_elem} bytes/elem)"),
        ("boundary (activation) bytes", f"{model.boundary_bytes / _MIB:.2f} MiB each, "
                                        f"{g.num_layers + 1} boundaries"),
        ("layer weights streamed", f"{model.layer_param_bytes / _MIB:.2f} MiB per layer"),
        ("layer forward / backward", f"{model.layer_fwd_flops / 1e9:.2f} / "
                                     f"{model.layer_bwd_flops / 1e9:.2f} GFLOP"),
    ):
        table.add_row(key, value)
    return table


def plan_table(columns: list[PlanColumn]) -> Table:
    """Strategies side by side: where boundaries live, what is recomputed, predicted time."""
    table = Table(title="Plan (predicted by the event simulator)", title_justify="left",
                  caption=_speedup_caption(columns), caption_justify="left")
    table.add_column("")
    for column in columns:
        table.add_column(column.name, justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("boundaries gpu / cpu / nvme", []), ("recomputed boundaries", []),
        ("recompute blocks", []), ("step (s)", []), ("compute / recompute (s)", []),
        ("exposed transfers (s)", []), ("tokens/s", []), ("peak device (MiB)", []),
        ("residents' update", []), ("solver", []),
    ]
    for column in columns:
        values = _column_values(column)
        for (_, cells), value in zip(rows, values, strict=True):
            cells.append(value)
    for label, cells in rows:
        table.add_row(label, *cells)
    return table


def _speedup_caption(columns: list[PlanColumn]) -> str | None:
    steps = [c.simulated.step_s for c in columns if c.simulated is not None]
    if len(columns) != 2 or len(steps) != 2:
        return None
    return (f"predicted step of {columns[0].name}: {steps[1] / steps[0]:.2f}x faster than "
            f"{columns[1].name} in the same device budget")


def _column_values(column: PlanColumn) -> list[str]:
    if column.plan is None or column.simulated is None:
        return ["infeasible", "-", column.infeasible_reason, *["-"] * 7]
    plan, sim = column.plan, column.simulated
    homes = plan.count_homes()
    blocks = [f"{s}-{e}" for s, e in plan.blocks if e - s > 1]
    return [
        f"{homes['gpu']} / {homes['cpu']} / {homes['nvme']}",
        str(homes["recompute"]),
        ", ".join(blocks) if blocks else "none",
        f"{sim.step_s:.4f}",
        f"{sim.compute_s:.4f} / {sim.recompute_s:.4f}",
        f"{sim.exposed_s:.4f}",
        f"{sim.tokens_per_s:,.0f}",
        f"{sim.peak_gpu_bytes / _MIB:.1f}",
        "GPU" if plan.resident_update == "device" else "host",
        f"{plan.solver.status} ({plan.solver.solve_s:.2f} s)",
    ]
