"""Several GPUs on a node (planning/node.py): one host copy of the state, each rank's own
buffers N times, the host memory bandwidth and the update split N ways."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, build_problem, make_plan
from lazytrain_accel.planning.host import host_base_terms
from lazytrain_accel.planning.node import EVERY_RANK, node_of_groups, owner_of_groups
from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.simulate import HOST_OPTIMIZER, host_optimizer_lane, simulate
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from tests.planning.planner_chains import GIB, chain

# A chain of 4 layers of 2**27 bf16 parameters (tied embeddings of 1,000,000 and a final
# norm of 1024): 537,871,936 trainable parameters; boundaries of 2**30 bytes.
TRAINABLE = 4 * 2**27 + 1_000_000 + 1024
SHARED_BYTES = (4 * TRAINABLE  # fp32 masters
                + 4 * TRAINABLE  # fp32 gradient accumulators
                + 2 * TRAINABLE + TRAINABLE // 32  # 8-bit moments + absmax per 256
                + 4 * 2**27 * 2)  # the layers' bf16 compute copies
PER_RANK_BYTES = 2 * 2**28 + 2 * 2**28  # two layers of weight and of gradient staging
#: On a node of several ranks, each also holds the gradient reduce's 16 MiB piece buffer
#: (`REDUCE_PIECE_NUMEL` fp32 elements), never a layer of them.
IN_FLIGHT_BYTES = 4 * 2**22
A = 2**30


def _chain(**knobs: float) -> tuple:
    return chain(num_layers=4, layer_param_gib=0.25, **knobs)


def test_host_bytes_count_the_shared_state_once_and_each_ranks_buffers_n_times() -> None:
    model, hardware = _chain()
    assert SHARED_BYTES == 6_469_269_682
    for ranks in (1, 8):
        terms = host_base_terms(model, weight_slots=3, ranks=ranks)
        assert sum(b for _, b in terms) == SHARED_BYTES + ranks * PER_RANK_BYTES + (
            ranks * IN_FLIGHT_BYTES if ranks > 1 else 0)
    eight = dict(host_base_terms(model, ranks=8))
    assert eight["pinned staging for weights (x 8 ranks)"] == 8 * 2 * 2**28
    assert eight["the trainable parameters' fp32 masters"] == 4 * TRAINABLE
    # The plan's terms: 2 NVMe bounce buffers and 3 DRAM-homed boundaries, per rank.
    one = build_problem(model, hardware, gpus_per_node=1).tier_need_bytes(
        gpu=0, cache=0, cpu=3, nvme=0)["cpu"]
    node = build_problem(model, hardware, gpus_per_node=8).tier_need_bytes(
        gpu=0, cache=0, cpu=3, nvme=0)["cpu"]
    assert one == SHARED_BYTES + PER_RANK_BYTES + (2 + 3) * A
    assert node == SHARED_BYTES + 8 * PER_RANK_BYTES + 8 * IN_FLIGHT_BYTES + 8 * (2 + 3) * A


def test_a_split_node_counts_the_pieces_crossing_to_the_other_nodes() -> None:
    """Split over K nodes, per rank: the piece it sends and one received from each node
    on the node that updates the group (`REDUCE_PIECE_NUMEL`), whatever the layer's size:
    a 405B layer's 12.9 GB of fp32 gradients are never held in flight."""
    model, _ = _chain()
    for ranks, nodes in ((1, 2), (8, 4)):
        terms = dict(host_base_terms(model, ranks=ranks, shards=nodes))
        name = "gradients in flight between ranks" + ("" if ranks == 1 else f" (x {ranks} ranks)")
        assert terms[name] == ranks * IN_FLIGHT_BYTES * (1 + nodes)
    assert "gradients in flight between ranks" not in dict(host_base_terms(model))


def _node_link_bytes_per_s(update_params_per_s: float, gpus_per_node: int) -> float:
    """The H2D rate of the 4-layer chain on a 100 GB/s host at that update rate."""
    model, hardware = _chain(h2d_gbps=40.0, d2h_gbps=40.0)
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=100e9,
                                   cpu_optimizer_params_per_s=update_params_per_s)
    return build_problem(model, hardware, gpus_per_node=gpus_per_node).h2d_bytes_per_s


def test_links_share_the_host_memory_bandwidth() -> None:
    model, hardware = _chain(h2d_gbps=12.0, d2h_gbps=10.0)
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=100e9,
                                   cpu_optimizer_params_per_s=1e8)
    # The update (5.4 s at 1e8 params/s) outlasts the compute-only step (0.83 s), so it is
    # charged all step: usable 0.75 x 100 GB/s less 1e8 x 18 B/s, 73.2 GB/s over 2 N streams.
    for n, h2d, d2h in ((1, 12e9, 10e9), (2, 12e9, 10e9), (4, 9.15e9, 9.15e9),
                        (8, 4.575e9, 4.575e9)):
        p = build_problem(model, hardware, gpus_per_node=n)
        assert p.host_update_param_count == TRAINABLE
        assert p.compute_s < TRAINABLE / 1e8
        assert (p.h2d_bytes_per_s, p.d2h_bytes_per_s) == pytest.approx((h2d, d2h))


def test_the_update_is_charged_by_its_share_of_the_step() -> None:
    """The updates move P_u x 18 bytes a step, over at least the compute-only step C and
    at least their own P_u / R seconds: an update that takes exactly C is charged R U as
    if it ran all step (the all-step rule), and a faster one the same, never more."""
    compute_s = build_problem(*_chain(), gpus_per_node=8).compute_s
    whole_step = TRAINABLE / compute_s  # params/s at which the update takes exactly C
    all_step = (0.75 * 100e9 - whole_step * 18) / (2 * 8)
    assert _node_link_bytes_per_s(whole_step, 8) == pytest.approx(all_step)
    faster = [_node_link_bytes_per_s(whole_step * k, 8) for k in (1, 2, 10, 1000)]
    assert faster == pytest.approx([all_step] * 4)
    for rate in (1e7, 1e8, 0.5 * whole_step, whole_step, 1e10, 1e12):
        # never below the all-step charge R U, which only slower updates reach
        assert _node_link_bytes_per_s(rate, 8) >= (0.75 * 100e9 - rate * 18) / 16 * (
            1 - 1e-12)


def test_without_a_host_bandwidth_one_gpu_is_never_host_bound() -> None:
    model, hardware = _chain(h2d_gbps=40.0, d2h_gbps=8.0)
    assert hardware.host_memory_bytes_per_s is None
    p = build_problem(model, hardware)
    assert (p.h2d_bytes_per_s, p.d2h_bytes_per_s) == (40e9, 8e9)
    assert 20e9 <= build_problem(model, hardware, gpus_per_node=2).h2d_bytes_per_s < 40e9


def test_an_update_that_fills_the_host_bandwidth_is_refused() -> None:
    model, hardware = _chain()
    # the update's 11.6 GB/s averaged over the step against 0.75 x 15 GB/s usable
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=15e9)
    with pytest.raises(ValueError, match="host_memory_bytes_per_s"):
        build_problem(model, hardware, gpus_per_node=2)


def test_presets_cite_their_host_bandwidth() -> None:
    assert HARDWARE_PRESETS["h800"].host_memory_bytes_per_s == 614.4e9
    for preset in HARDWARE_PRESETS.values():
        assert preset.host_memory_bytes_per_s and "host DRAM" in preset.source


def test_the_update_is_split_in_contiguous_runs_at_the_share_rate() -> None:
    model, hardware = _chain()
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=1e12)
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all",
                                                  gpus_per_node=2, resident_update="host"))
    ops = {op.name: op for op in simulate(plan, model, hardware).ops}
    lanes = [ops[name].resource for name in ("U_embed", "U1", "U2", "U3", "U4", "U_head")]
    assert lanes == [HOST_OPTIMIZER] * 3 + [f"{HOST_OPTIMIZER}/1"] * 3
    assert ops["U1"].duration_s == pytest.approx(2**27 / (1e9 / 2))
    assert ops["U3"].start_s < ops["U2"].end_s  # the shares run side by side


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("resident_update", ["host", "device"])
def test_the_simulator_splits_the_update_by_the_engines_rule(ranks: int,
                                                             resident_update: str) -> None:
    """The lanes are `owner_of_groups` of the groups' trainable parameters: the rule
    `distributed/ownership.py` gives the engine's ranks (test_node_store.py)."""
    model, hardware = _chain()
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=1e12)
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all", gpus_per_node=ranks,
                                                  resident_update=resident_update))
    ops = {op.name: op for op in simulate(plan, model, hardware).ops}
    head = 1024  # the final norm (tied embeddings)
    groups = [1_000_000, *[2**27] * 4, head]
    every = (0, 5) if resident_update == "device" else ()
    owners = owner_of_groups(groups, ranks, every_rank=every)
    names = ["U_embed", "U1", "U2", "U3", "U4", "U_head"]
    lanes = {name: ops[name].resource for name in names if name in ops}
    assert lanes == {name: host_optimizer_lane(owner) for name, owner in zip(names, owners,
                                                                           strict=True)
                     if owner != EVERY_RANK}


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_the_split_layout_cuts_each_local_ranks_run_over_the_nodes(nodes: int) -> None:
    """`node_of_groups` (the split layout's rule): each local rank's run of groups is cut
    over the nodes, contiguous, in forward order, balanced by bytes as the ranks are;
    every-rank groups stay every node's."""
    groups = [1_000_000, *[2**20] * 12, 1024]
    owners = owner_of_groups(groups, 2, every_rank=(0, 13))
    node_of = node_of_groups(groups, owners, nodes)
    assert [g for g, n in enumerate(node_of) if n == EVERY_RANK] == [0, 13]
    for rank in (0, 1):
        run = [node_of[g] for g, owner in enumerate(owners) if owner == rank]
        assert run == sorted(run) and set(run) == set(range(nodes))  # contiguous, all
        counts = [run.count(n) for n in range(nodes)]
        assert max(counts) - min(counts) <= 1  # equal layers: equal shares


def test_the_next_forward_waits_on_the_first_shares_run() -> None:
    """Contiguous ownership: share 0 updates U_embed, U1, U2 one after the other, so the
    next forward's layer 2 waits for share 0's whole run; the shares' lanes otherwise
    overlap. The exposure is what the first lane's run leaves uncovered."""
    model, hardware = _chain()
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=1e12,
                                   cpu_optimizer_params_per_s=1e8)  # a slow update
    plan = make_plan(model, hardware, PlanRequest(strategy="checkpoint_all", gpus_per_node=2,
                                                  resident_update="host"))
    result = simulate(plan, model, hardware)
    ops = {op.name: op for op in result.ops}
    assert ops["U1"].start_s >= ops["U_embed"].end_s and ops["U2"].start_s >= ops["U1"].end_s
    assert ops["U3"].start_s < ops["U1"].end_s
    step_s = result.step_s - result.optimizer_exposed_s
    fwd_s = result.compute_s / 4 / 3  # checkpoint_all: f + (f + b) per layer, b = 2 f
    # layer 2 of the next step starts its weights' load at step_s + fwd_s at the earliest
    assert result.optimizer_exposed_s >= ops["U2"].end_s - step_s - fwd_s - 1e-9


def test_the_node_host_peak_counts_every_ranks_boundaries() -> None:
    model, hardware = _chain()
    hardware = dataclasses.replace(hardware, host_memory_bytes_per_s=1e12)
    peaks = {}
    for n in (1, 4):
        plan = make_plan(model, hardware, PlanRequest(strategy="offload_all", gpus_per_node=n,
                                                      resident_update="host"))
        static = build_problem(model, hardware, gpus_per_node=n).static_cpu_bytes
        peaks[n] = plan.prediction.peak_cpu_bytes - static
        assert plan.gpus_per_node == n
    assert peaks[1] > 0 and peaks[4] == 4 * peaks[1]


def test_a_node_plans_where_n_copies_would_not_fit(tmp_path) -> None:
    model, hardware = _chain()
    # one copy + 8 ranks' own (their staging, a layer in flight, 2 boundaries)
    budget = SHARED_BYTES + 8 * (PER_RANK_BYTES + IN_FLIGHT_BYTES) + 8 * 2 * A + GIB
    budgets = Budgets(gpu_bytes=80 * GIB, cpu_bytes=budget, nvme_bytes=0)
    one = make_plan(model, hardware, PlanRequest(budgets=budgets))
    assert 8 * one.prediction.peak_cpu_bytes > budget  # 8 copies of the state do not fit
    node = make_plan(model, hardware, PlanRequest(budgets=budgets, gpus_per_node=8, nodes=2,
                                                  node_layout="replicated"))
    assert node.prediction.peak_cpu_bytes <= budget
    path = tmp_path / "plan.json"
    node.save(path)
    assert (Plan.load(path).gpus_per_node, Plan.load(path).nodes) == (8, 2)
    with pytest.raises(PlanInfeasibleError, match="cpu"):
        make_plan(model, hardware, PlanRequest(budgets=dataclasses.replace(
            budgets, cpu_bytes=SHARED_BYTES), gpus_per_node=8, diagnose_s=0))


@pytest.mark.parametrize("field", ["gpus_per_node", "nodes"])
def test_a_bad_node_shape_names_its_flag(field: str) -> None:
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}=0"):
        PlanRequest(**{field: 0})
