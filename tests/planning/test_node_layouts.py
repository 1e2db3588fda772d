"""The host state across nodes (issue 45, the planner's side): the split layout keeps every
layer's compute copy on each node and 1/K of the masters, moments and gradients, and
sends a reduce-scatter of the gradients and an all-gather of the compute copy; the
replicated one keeps all of it and all-reduces the gradients. `lazytrain plan --nodes K`
prints both; 405B plans split on 2 TB nodes and is refused replicated."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazytrain_accel.cli import main
from lazytrain_accel.planning import Budgets, PlanInfeasibleError, build_problem, make_plan
from lazytrain_accel.planning.host import host_base_terms
from lazytrain_accel.planning.layouts import layout_figures
from lazytrain_accel.planning.node import network_bytes_per_step, resolve_node_layout
from lazytrain_accel.planning.plan import Plan, PlanError
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)
from tests.planning.planner_chains import GIB, chain
from tests.planning.test_node import IN_FLIGHT_BYTES, PER_RANK_BYTES, SHARED_BYTES, TRAINABLE

#: The chain's bf16 compute copies (test_node.py's SHARED_BYTES holds them once).
COPIES = 4 * 2**27 * 2


def crossing_bytes(ranks: int, nodes: int) -> int:
    """What a split node's ranks hold crossing from the other nodes: per rank one 16 MiB
    piece received from each node (beside the piece each sends, `IN_FLIGHT_BYTES`)."""
    return ranks * nodes * IN_FLIGHT_BYTES


def _chain() -> tuple:
    return chain(num_layers=4, layer_param_gib=0.25)


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_a_split_node_holds_its_copies_and_a_kth_of_the_rest(nodes: int) -> None:
    model, _ = _chain()
    replicated = sum(b for _, b in host_base_terms(model, weight_slots=3, ranks=8))
    split = sum(b for _, b in host_base_terms(model, weight_slots=3, ranks=8, shards=nodes))
    assert replicated == SHARED_BYTES + 8 * PER_RANK_BYTES + 8 * IN_FLIGHT_BYTES
    # the residents' masters (cast each pass: no compute copy) stay whole on every node
    resident_masters = 4 * model.resident_trainable_param_count
    # the layers' masters, gradients, moments: cut K ways, rounded up
    rest = SHARED_BYTES - COPIES - resident_masters
    own = (COPIES + resident_masters + 8 * PER_RANK_BYTES + 8 * IN_FLIGHT_BYTES
           + crossing_bytes(8, nodes))
    assert resident_masters > 0
    assert split - own == pytest.approx(rest / nodes, abs=3)
    named = dict(host_base_terms(model, ranks=8, shards=nodes))
    assert named[f"the trainable parameters' fp32 gradients (1/{nodes} per node)"] == (
        -(-4 * TRAINABLE // nodes))


def test_with_fp32_compute_the_masters_stay_whole_on_every_node() -> None:
    """fp32 compute streams the masters themselves: no compute copy to keep instead."""
    model = dataclasses.replace(_chain()[0], compute_bytes_per_elem=4)
    terms = dict(host_base_terms(model, shards=4))
    assert terms["the trainable parameters' fp32 masters"] == 4 * TRAINABLE
    assert terms["the trainable parameters' fp32 gradients (1/4 per node)"] == TRAINABLE
    hardware = _chain()[1]
    layer = model.layer_trainable_param_count
    sizes = build_problem(model, hardware, nodes=4, node_layout="split").state_sizes
    assert (sizes.master_bytes, sizes.grads_bytes) == (4 * layer, layer)
    bf16 = build_problem(_chain()[0], hardware, nodes=4, node_layout="split").state_sizes
    assert (bf16.master_bytes, bf16.grads_bytes) == (layer, layer)


def test_network_bytes_per_step_of_each_layout() -> None:
    """Ring collectives: each node sends (K-1)/K of a buffer per pass."""
    P = 10**9
    for k in (2, 4, 8):
        share = (k - 1) / k
        assert network_bytes_per_step(host_update_params=P, every_rank_params=0,
                                      copy_bytes_per_param=2, nodes=k,
                                      layout="replicated") == int(2 * share * 4 * P)
        assert network_bytes_per_step(host_update_params=P, every_rank_params=0,
                                      copy_bytes_per_param=2, nodes=k,
                                      layout="split") == int(share * (4 + 2) * P)
    # residents with masters on every GPU: all-reduced in both layouts
    assert network_bytes_per_step(host_update_params=0, every_rank_params=P,
                                  copy_bytes_per_param=2, nodes=2, layout="split") == 4 * P
    assert network_bytes_per_step(host_update_params=P, every_rank_params=P,
                                  copy_bytes_per_param=2, nodes=1, layout="split") == 0


def test_a_split_node_updates_a_kth_of_each_layer() -> None:
    model, hardware = _chain()
    one = build_problem(model, hardware, gpus_per_node=2)
    four = build_problem(model, hardware, gpus_per_node=2, nodes=4, node_layout="split")
    assert four.layer_update_s == pytest.approx(one.layer_update_s / 4)
    assert four.host_update_param_count == -(-one.host_update_param_count // 4)
    same = build_problem(model, hardware, gpus_per_node=2, nodes=4, node_layout="replicated")
    assert same.layer_update_s == one.layer_update_s
    assert same.static_cpu_bytes == one.static_cpu_bytes > four.static_cpu_bytes


def test_auto_splits_over_several_nodes_only() -> None:
    assert resolve_node_layout("auto", 1) == "replicated"
    assert resolve_node_layout("auto", 4) == "split"
    assert resolve_node_layout("replicated", 4) == "replicated"
    with pytest.raises(ValueError, match="node_layout='halves'"):
        PlanRequest(nodes=2, node_layout="halves")


def test_the_plan_file_keeps_its_layout(tmp_path) -> None:
    model, hardware = _chain()
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all", nodes=2,
                                                  gpus_per_node=2))
    assert (plan.nodes, plan.node_layout) == (2, "split")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").node_layout == "split"
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["node_layout"]  # a plan file from before: today's replicated copy
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").node_layout == "replicated"
    data["node_layout"] = "halves"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="node_layout='halves'"):
        Plan.load(tmp_path / "bad.json")


def test_layout_figures_swap_the_state_terms_and_nothing_else() -> None:
    model, hardware = _chain()
    budgets = Budgets.from_hardware(hardware)
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all", nodes=4,
                                                  gpus_per_node=2, budgets=budgets,
                                                  resident_update="host"))
    figures = layout_figures(plan, model, hardware, budgets)
    split, replicated = figures["split"], figures["replicated"]
    assert split.host_bytes == plan.prediction.peak_cpu_bytes
    rest = SHARED_BYTES - COPIES - 4 * model.resident_trainable_param_count
    assert replicated.host_bytes - split.host_bytes == pytest.approx(
        rest * 3 / 4 - crossing_bytes(2, 4), abs=3)
    assert split.network_bytes < replicated.network_bytes
    assert split.network_s == split.network_bytes / hardware.internode_bytes_per_s
    slow = split.network_s > plan.prediction.step_s
    assert split.job_tokens_per_s(plan) <= 8 * plan.prediction.tokens_per_s * (1 + 1e-12)
    assert (split.job_tokens_per_s(plan) < 8 * plan.prediction.tokens_per_s) == slow


def test_405b_plans_split_on_2tb_nodes_and_replicated_is_refused() -> None:
    """The issue's bar: 405B on nodes of 8 H200s and 2048 GiB of host, at K = 4 and 8. At
    K = 4 the split node was refused, 125 GiB short, while each rank's gradient reduce held
    whole layers of fp32 gradients in flight (a 405B layer is 12.9 GB of them; 3 a rank,
    310 GB a node): the reduce sends 16 MiB pieces now, 0.6 GiB a node at K = 4."""
    config = load_model_config("llama3.1-405b")
    model = profile_model(geometry_from_config(config, name="llama3.1-405b"), batch_size=1,
                          seq_len=4096, compute_bytes_per_elem=2)
    h200 = HARDWARE_PRESETS["h200"]
    budgets = dataclasses.replace(Budgets.from_hardware(h200), cpu_bytes=2048 * GIB)
    in_flight = dict(host_base_terms(model, ranks=8, shards=4))[
        "gradients in flight between ranks (x 8 ranks)"]
    assert in_flight == 8 * 5 * 16 * 2**20
    for nodes in (4, 8):
        request = PlanRequest(gpus_per_node=8, nodes=nodes, budgets=budgets,
                              time_limit_s=2.0)
        plan = make_plan(model, h200, request)
        assert plan.node_layout == "split" and plan.prediction.peak_cpu_bytes <= budgets.cpu_bytes
        figures = layout_figures(plan, model, h200, budgets)
        split, replicated = figures["split"], figures["replicated"]
        assert split.fits and not replicated.fits
        assert replicated.host_bytes > 2 * budgets.cpu_bytes
        assert 0 < split.network_bytes < replicated.network_bytes
        with pytest.raises(PlanInfeasibleError, match="--node-layout split"):
            make_plan(model, h200, dataclasses.replace(request, node_layout="replicated",
                                                       diagnose_s=0.0))


def test_plan_prints_both_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    run = ["--model", "qwen3.6-27b", "--hardware", "h800", "--batch-size", "8",
           "--seq-len", "1024", "--cpu-memory-gb", "1024", "--gpus-per-node", "8",
           "--nodes", "4"]
    assert main(["plan", *run, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["node_layout"] == "split" and s["node_layouts"]["replicated"]["fits"]
    split = s["node_layouts"]["split"]
    assert main(["plan", *run]) == 0
    out = capsys.readouterr().out
    assert f"layout split: host {split['host_bytes'] / GIB:.2f} GiB per node" in out
    assert "vs replicated: host" in out and "job: 4 nodes" in out
    assert main(["plan", *run, "--node-layout", "replicated"]) == 0
    assert "layout replicated: host" in capsys.readouterr().out
    assert main(["simulate", *run]) == 0  # the same lines for a simulated plan
    out = capsys.readouterr().out
    assert "layout split: host" in out and "vs replicated: host" in out


def test_replicated_refusal_names_the_split_layout() -> None:
    model, hardware = _chain()
    # the state (6.0 GiB) whole does not fit; a quarter of all but its copies does
    tight = dataclasses.replace(Budgets.from_hardware(hardware), cpu_bytes=7 * GIB)
    request = PlanRequest(strategy="checkpoint_all", nodes=4, budgets=tight,
                          node_layout="replicated", host_state="dram", diagnose_s=0.0)
    with pytest.raises(PlanInfeasibleError, match="--node-layout split"):
        make_plan(model, hardware, request)
    split = make_plan(model, hardware, dataclasses.replace(request, node_layout="split"))
    assert split.prediction.peak_cpu_bytes <= tight.cpu_bytes


def test_the_plan_cache_keeps_each_layout_apart(tmp_path) -> None:
    """A cached replicated plan is not the split run's (both launches of one job share the
    cache directory): the cache key holds the layout."""
    from lazytrain_accel.config import LazyTrainConfig
    from lazytrain_accel.run.setup import resolve_plan

    model, hardware = chain(num_layers=4)
    plans = {layout: resolve_plan(LazyTrainConfig(plan="checkpoint_all", node_layout=layout,
                                                  cache_dir=str(tmp_path)),
                                  model, hardware, gpus_per_node=2, nodes=2)
             for layout in ("replicated", "split")}
    assert {layout: p.node_layout for layout, p in plans.items()} == {
        "replicated": "replicated", "split": "split"}
    assert len(list((tmp_path / "plans").iterdir())) == 2
