"""The event simulator against the MIP's window model; plan JSON and fingerprints."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from planner_chains import budgets_in_slots, chain, instances

from lazytrain_accel.planning import (
    Home,
    Plan,
    PlanError,
    PlanInfeasibleError,
    build_problem,
    make_plan,
    simulate,
)
from lazytrain_accel.planning.baselines import BASELINES
from lazytrain_accel.planning.plan import TransferKind
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.timeline import chrome_trace, draw_timeline


def _plans(instance: tuple) -> list[Plan]:
    model, hardware, budgets, K = instance
    plans = []
    for strategy in ("lazytrain", *BASELINES):
        try:
            request = PlanRequest(strategy=strategy, budgets=budgets, max_recompute_block=K,
                                  gap=0.0, time_limit_s=30)
            plans.append(make_plan(model, hardware, request))
        except PlanInfeasibleError:
            continue
    return plans


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_layers=12))
def test_simulator_agrees_with_mip_and_respects_capacity(instance: tuple) -> None:
    model, hardware, budgets, _ = instance
    for plan in _plans(instance):
        result = simulate(plan, model, hardware)
        assert result.step_s == pytest.approx(plan.prediction.step_s, rel=0.05), plan.strategy
        assert result.peak_gpu_bytes <= budgets.gpu_bytes, plan.strategy
        assert result.peak_cpu_bytes <= budgets.cpu_bytes, plan.strategy
        assert result.peak_nvme_bytes <= budgets.nvme_bytes, plan.strategy
        assert result.recompute_s == pytest.approx(plan.prediction.recompute_s)


def test_transfers_are_ordered_and_complete() -> None:
    model, hardware = chain(num_layers=10, d2h_gbps=8.0, h2d_gbps=8.0)
    budgets = budgets_in_slots(model, hardware, gpu_slots=5, cpu_slots=3, nvme_slots=3)
    plan = make_plan(model, hardware, PlanRequest(budgets=budgets, gap=0.0))
    L = plan.num_layers
    assert Home.NVME in plan.homes and Home.CPU in plan.homes
    for i, home in enumerate(plan.homes):
        moved = {k: [t for t in plan.transfers if t.boundary == i and t.kind == k]
                 for k in TransferKind}
        expected = {TransferKind.D2H, TransferKind.H2D} if home == Home.CPU else (
            set(TransferKind) if home == Home.NVME else set())
        assert {k for k, ts in moved.items() if ts} == expected
        for ts in moved.values():
            assert ts == [] or sum(t.bytes for t in ts) == plan.boundary_bytes
        if expected:
            assert min(t.window for t in moved[TransferKind.D2H]) >= i  # after F_i
            assert max(t.window for t in moved[TransferKind.H2D]) < 2 * L - i - 1  # < B_{i+1}
        if home == Home.NVME:
            assert (min(t.window for t in moved[TransferKind.NVME_WRITE])
                    > min(t.window for t in moved[TransferKind.D2H]))
            assert (max(t.window for t in moved[TransferKind.NVME_READ])
                    < max(t.window for t in moved[TransferKind.H2D]))


def test_megatrain_recompute_costs_time_and_restream() -> None:
    model, hardware = chain(num_layers=8, fwd_s=0.05)
    plan = make_plan(model, hardware, PlanRequest(strategy="megatrain"))
    assert plan.blocks == [(0, 4), (4, 8)]
    result = simulate(plan, model, hardware)
    assert result.recompute_s == pytest.approx(2 * 3 * 0.05)
    weight_loads = [op for op in result.ops if op.name.startswith("RW")]
    assert len(weight_loads) == 6  # layers 1-3 and 5-7 cross PCIe a third time


def test_the_head_streams_beside_what_the_last_forward_issued() -> None:
    """The engine runs the head between the last forward run and the first backward run,
    which issues B_L's transfers: the re-stream of the last block's first layer, issued in
    F_L, streams beside the head, and only that block's first re-run waits for it. The
    window model holds the head in F_L's window, so the MIP prices the same step."""
    model, hardware = chain(num_layers=8, fwd_s=0.05, h2d_gbps=6.0)  # a load: ~1.8 forwards
    plan = make_plan(model, hardware, PlanRequest(strategy="megatrain"))
    assert plan.blocks[-1] == (4, 8)
    result = simulate(plan, model, hardware, include_optimizer=False)
    ops = {op.name: op for op in result.ops}
    assert ops["RW5"].end_s > ops["F8"].end_s  # still streaming when F8 ends
    assert ops["head"].start_s == pytest.approx(ops["F8"].end_s)  # nothing to wait for
    assert ops["R5"].start_s == pytest.approx(max(ops["head"].end_s, ops["RW5"].end_s))
    p = build_problem(model, hardware)
    assert p.step_floor_s() + plan.solver.objective_s == pytest.approx(result.step_s, rel=0.01)


def test_plan_json_round_trip_and_foreign_fingerprint(tmp_path: Path) -> None:
    model, hardware = chain(num_layers=6)
    budgets = budgets_in_slots(model, hardware, gpu_slots=4, cpu_slots=2, nvme_slots=1)
    plan = make_plan(model, hardware, PlanRequest(budgets=budgets))
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert json.loads(path.read_text())["fingerprint"] == plan.fingerprint
    other, _ = chain(num_layers=6, batch_size=8)
    with pytest.raises(PlanError, match="made for another run"):
        simulate(again, other, hardware)


@pytest.mark.parametrize(("tile", "block", "tiling"), [
    (0, 0, "none"), (64, 0, "mlp"), (64, 64, "layer"), (0, 64, "layer")])
def test_a_plan_file_with_the_two_tile_sizes_loads_as_one_tiling(
        tmp_path: Path, tile: int, block: int, tiling: str) -> None:
    """A plan file of before `Plan.tiling` (tile_tokens + attention_block_tokens) loads."""
    model, hardware = chain(num_layers=4)
    old = make_plan(model, hardware, PlanRequest()).to_dict()
    del old["tiling"]
    old.update(tile_tokens=tile, attention_block_tokens=block)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    plan = Plan.load(path)
    assert (plan.tiling, plan.tile_tokens) == (tiling, max(tile, block))
    assert plan.attention_block_tokens == block
    assert "attention_block_tokens" not in plan.to_dict()


def test_a_plan_file_with_mlp_tiles_inside_other_query_blocks_is_refused(tmp_path) -> None:
    model, hardware = chain(num_layers=4)
    old = {**make_plan(model, hardware, PlanRequest()).to_dict(), "tile_tokens": 32,
           "attention_block_tokens": 64}
    del old["tiling"]
    with pytest.raises(PlanError, match="one size; re-run `lazytrain plan`"):
        Plan.from_dict(old)
    new = make_plan(model, hardware, PlanRequest()).to_dict()
    with pytest.raises(PlanError, match="0 exactly when the tiling is 'none'"):
        Plan.from_dict({**new, "tiling": "mlp", "tile_tokens": 0})
    with pytest.raises(PlanError, match="is not one of"):
        Plan.from_dict({**new, "tiling": "attention", "tile_tokens": 64})


def test_timeline_png_and_chrome_trace(tmp_path: Path) -> None:
    model, hardware = chain(num_layers=6)
    budgets = budgets_in_slots(model, hardware, gpu_slots=4, cpu_slots=2, nvme_slots=1)
    plan = make_plan(model, hardware, PlanRequest(budgets=budgets, resident_update="host"))
    result = simulate(plan, model, hardware)
    trace = chrome_trace(result)
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"F1", "B1", "W2", "U_embed", "U1", "U6", "U_head"} <= names
    lanes = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"]
    assert lanes[-1] == "host_optimizer"
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
    png = tmp_path / "timeline.png"
    draw_timeline(result, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_planning_imports_neither_torch_nor_pyscipopt_outside_milp() -> None:
    code = ("import sys, lazytrain_accel.planning, lazytrain_accel.planning.simulate;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    package = Path(__file__).parents[2] / "lazytrain_accel" / "planning"
    users = sorted(f.name for f in package.glob("*.py") if "pyscipopt" in f.read_text())
    assert users == ["milp.py"]


def test_host_optimizer_order_embeddings_layers_head() -> None:
    """The engine's order (engine/step/overlap.py): U_embed, U1..UL, U_head; the next forward
    waits for U_embed and Uj, only its head for U_head (here the slow one: a big untied
    head on a slow host optimizer)."""
    model, hardware = chain(num_layers=6)
    g = model.geometry
    model = dataclasses.replace(model, geometry=dataclasses.replace(
        g, tied_embeddings=False, head_param_count=40 * g.layer_param_count))
    hardware = dataclasses.replace(hardware, cpu_optimizer_params_per_s=2e10)
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all"))
    without = simulate(plan, model, hardware, include_optimizer=False)
    result = simulate(plan, model, hardware)
    ops = [op for op in result.ops if op.resource == "host_optimizer"]
    assert [op.name for op in ops] == ["U_embed", *(f"U{j}" for j in range(1, 7)), "U_head"]
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(ops))
    rate = hardware.cpu_optimizer_params_per_s
    assert ops[0].duration_s == pytest.approx(g.embedding_param_count / rate)
    assert ops[-1].duration_s == pytest.approx(
        (40 * g.layer_param_count + g.final_norm_param_count) / rate)
    p = build_problem(model, hardware, max_recompute_block=1)
    head_late_s = ops[-1].end_s - without.step_s - p.prologue_s - 6 * p.fwd_run_s
    assert head_late_s > 0.0 and ops[1].end_s - without.step_s < 0.5 * head_late_s
    assert result.optimizer_exposed_s == pytest.approx(head_late_s)
    assert result.step_s == pytest.approx(without.step_s + head_late_s)


def test_concurrent_saves_of_one_plan_path_never_take_each_others_file(
        tmp_path: Path, errors_of_concurrent_calls: Callable[..., list]) -> None:
    """The ranks of a launch fill one plan cache: writers of the same path at once each
    rename a temporary file of their own, so none fails and the file is always whole."""
    model, hardware = chain(num_layers=6)
    budgets = budgets_in_slots(model, hardware, gpu_slots=4, cpu_slots=2, nvme_slots=1)
    plan = make_plan(model, hardware, PlanRequest(budgets=budgets))
    path = tmp_path / "plan.json"
    assert errors_of_concurrent_calls(lambda: plan.save(path)) == []
    assert Plan.load(path) == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary left


def _host_priced(*, stage_s: float, fold_s: float, on_compute: bool) -> tuple:
    """An 8-layer chain whose links hide behind compute, the host's work per transfer
    priced at `stage_s` a layer's weights and `fold_s` a layer's gradients."""
    model, bare = chain(num_layers=8, h2d_gbps=100.0, d2h_gbps=100.0)
    hardware = dataclasses.replace(
        bare, host_stage_bytes_per_s=model.layer_param_bytes / stage_s,
        host_fold_bytes_per_s=model.layer_grad_bytes / fold_s, compute_on_host=on_compute)
    return model, bare, hardware


def test_the_hosts_work_per_transfer_takes_the_compute_thread_on_a_cpu_device() -> None:
    model, bare, hardware = _host_priced(stage_s=0.01, fold_s=0.02, on_compute=True)
    budgets = budgets_in_slots(model, hardware, gpu_slots=6, cpu_slots=0, nvme_slots=0,
                               max_recompute_block=4)
    request = PlanRequest(budgets=budgets, max_recompute_block=4, gap=0.0)
    plan = make_plan(model, hardware, request)
    assert plan.recomputed_layer_runs > 0  # re-streamed layers are staged too
    without = simulate(plan, model, bare, include_optimizer=False)
    result = simulate(plan, model, hardware, include_optimizer=False)
    loads = sum(1 for op in result.ops if op.resource == "h2d" and op.name[0] in "RW")
    assert result.host_s == pytest.approx(loads * 0.01 + 8 * 0.02)
    # the work takes the compute's time, less what it hides of the copies in flight when
    # it starts (the engine stages and folds before it waits for the run's weights)
    assert without.step_s + 0.9 * result.host_s < result.step_s <= without.step_s + result.host_s
    assert result.step_s == pytest.approx(result.compute_s + result.recompute_s
                                          + result.overhead_s + result.host_s + result.exposed_s)
    # the MIP prices the same step: its floor and objective hold the host's work
    p = build_problem(model, hardware, budgets=budgets, max_recompute_block=4)
    mip_s = p.step_floor_s() + plan.solver.objective_s
    assert mip_s == pytest.approx(result.step_s, rel=0.01)


def test_on_a_gpu_the_hosts_work_hides_behind_the_kernels_until_it_is_longer() -> None:
    model, bare, fast = _host_priced(stage_s=0.01, fold_s=0.02, on_compute=False)
    plan = make_plan(model, bare, PlanRequest(strategy="checkpoint_all"))
    without = simulate(plan, model, bare, include_optimizer=False)
    hidden = simulate(plan, model, fast, include_optimizer=False)
    assert hidden.host_s == 0.0  # not the compute's thread
    # what the device waits for: staging the first two layers, the drain's last folds
    assert without.step_s < hidden.step_s <= without.step_s + 2 * 0.01 + 3 * 0.02 + 1e-9
    _, _, slow = _host_priced(stage_s=0.08, fold_s=0.02, on_compute=False)  # > a forward
    bound = simulate(plan, model, slow, include_optimizer=False)
    assert bound.exposed_by_link_s["host"] > 8 * (0.08 - 0.05) - 1e-9
    p = build_problem(model, slow, max_recompute_block=1)
    solution = make_plan(model, slow, PlanRequest(strategy="checkpoint_all")).solver
    assert p.step_floor_s() + solution.objective_s == pytest.approx(bound.step_s, rel=0.05)


def test_on_a_cpu_device_the_update_takes_the_computes_cores_and_adds_to_the_step() -> None:
    """Where the device's compute is the host's cores, the overlapped update does not hide
    behind the next forward: the step pays it whole (the slowest share's lane); on a GPU
    the same plan pays only what the next forward waits for."""
    model, hardware = chain(num_layers=6)
    hardware = dataclasses.replace(hardware, cpu_optimizer_params_per_s=2e10)
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all",
                                                  resident_update="host"))
    hidden = simulate(plan, model, hardware)
    on_host = dataclasses.replace(hardware, compute_on_host=True)
    without = simulate(plan, model, on_host, include_optimizer=False)
    serial = simulate(plan, model, on_host)
    update_s = sum(op.duration_s for op in serial.ops if op.resource == "host_optimizer")
    assert update_s == pytest.approx(model.trainable_param_count
                                     / hardware.cpu_optimizer_params_per_s)
    assert serial.optimizer_exposed_s == pytest.approx(update_s)
    assert serial.step_s == pytest.approx(without.step_s + update_s)
    assert hidden.optimizer_exposed_s < 0.5 * update_s


def test_a_synchronous_device_copies_on_the_training_thread_at_the_links_rates() -> None:
    """A CPU device runs a layer's weight copy and gradient copy on the training thread:
    priced as its work per transfer at the links' rates, not as staging and folding
    (which it does not do); an async device keeps its staging and folding rates."""
    model, hardware = chain(num_layers=4)
    hardware = dataclasses.replace(hardware, host_stage_bytes_per_s=1e12,
                                   host_fold_bytes_per_s=1e12, compute_on_host=True)
    cpu = build_problem(model, dataclasses.replace(hardware, device_runs_async=False))
    assert cpu.stage_s == pytest.approx(model.layer_param_bytes / hardware.h2d_bytes_per_s)
    assert cpu.fold_s == pytest.approx(model.layer_grad_bytes / hardware.d2h_bytes_per_s)
    emulated = build_problem(model, hardware)
    assert emulated.stage_s == pytest.approx(model.layer_param_bytes / 1e12)
