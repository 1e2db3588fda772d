"""Agreement as a property (issue 34): over drawn problems (model families, batch shapes,
budgets, where the residents' update runs; compute-, H2D-, D2H- and NVMe-bound rates; the
host's work per transfer unpriced, on the compute's thread, or beside a GPU's kernels), the
plan `make_plan` returns, priced by the simulator with the host update beside it, is never
slower than a baseline (megatrain, checkpoint_all, offload_all) or, in a re-plan after one
link slows 12x, than the running plan, beyond `TOLERANCE`; nor is the MIP's own pick
(`Solution.mip_step_s` where the simulator preferred another). Where the MIP's objective
and the simulator disagree beyond it, the failure names the term mispriced: the windows'
compute, the host's work per transfer, a link's exposure, or the host update's overlap
with the next step.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from planner_chains import budgets_in_slots

from lazytrain_accel.planning import (
    Budgets,
    PlanInfeasibleError,
    build_problem,
    make_plan,
    simulate,
)
from lazytrain_accel.planning.baselines import BASELINES
from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.problem import GIB, Problem
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.families import geometry_from_config
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.model_configs import profile_model
from lazytrain_accel.profiling.profile import ModelProfile

EXAMPLES = 100
#: A fraction of the step: what the MIP's window model may leave unpriced (the host
#: update's overlap with the next step, a few tie-breakers) without picking a worse plan.
TOLERANCE = 0.02
FAMILIES = ("llama", "qwen2", "mistral", "gemma")
REGIMES = ("compute", "h2d", "d2h", "nvme")
#: How much the bound link of a regime is slower than one layer's forward needs.
SLOW = 0.2


def _model(family: str, layers: int, batch_size: int, seq_len: int, vocab_size: int = 256,
           compute_bytes_per_elem: int = 4) -> ModelProfile:
    config = {"model_type": family, "vocab_size": vocab_size, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": layers,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 512, "tie_word_embeddings": family == "gemma"}
    return profile_model(geometry_from_config(config, name=f"tiny-{family}"),
                         batch_size=batch_size, seq_len=seq_len,
                         compute_bytes_per_elem=compute_bytes_per_elem)


#: The host's work per transfer (`HardwareProfile.host_stage_bytes_per_s`, ...): a layer's
#: staging and its fold in these fractions of one layer forward; None: not priced.
HOST_WORK = {"none": None, "fast": (0.3, 0.5), "slow": (1.5, 2.0)}


def _hardware(model: ModelProfile, regime: str, async_device: bool, host: str = "none",
              compute_on_host: bool = False) -> HardwareProfile:
    """Rates set against one layer's forward (1e10 FLOP/s): the regime's links are
    `SLOW` x what would hide their traffic behind it, the others 20x faster than that; the
    host's work per transfer as `HOST_WORK[host]`, on the compute's thread or not."""
    flops = 1e10
    fwd_s = model.layer_fwd_flops / flops
    fractions = HOST_WORK[host]
    stage, fold = (0.0, 0.0) if fractions is None else (
        model.layer_param_bytes / (fractions[0] * fwd_s),
        model.layer_grad_bytes / (fractions[1] * fwd_s))
    fast = {"h2d": model.layer_param_bytes, "d2h": model.layer_grad_bytes,
            "nvme": model.boundary_bytes}
    rate = {k: (SLOW if k == regime else 20.0) * b / fwd_s for k, b in fast.items()}
    return dataclasses.replace(
        HARDWARE_PRESETS["h800"], name=f"{regime}-bound", achieved_flops_per_s=flops,
        h2d_bytes_per_s=rate["h2d"], d2h_bytes_per_s=rate["d2h"],
        nvme_read_bytes_per_s=rate["nvme"], nvme_write_bytes_per_s=rate["nvme"],
        cpu_optimizer_params_per_s=model.layer_trainable_param_count / fwd_s,
        device_runs_async=async_device, host_stage_bytes_per_s=stage,
        host_fold_bytes_per_s=fold, compute_on_host=compute_on_host)


def d2h_drift() -> tuple:
    """What issue 34's run found (tests/frontends/test_replanner.py, bench/replan.py
    `compare_d2h_drift`): Llama, batch 8 x 128, 8 GPU and 6 host boundaries of room, the
    emulated device's links; the plan for them updates the residents on the GPU, and a
    re-plan after the device->host link slows 12x kept them there by charging them to the
    GPU budget first, then had to offload over that link: 1.5x slower than the running
    plan."""
    model = _model("llama", 8, 8, 128, vocab_size=64)
    hardware = dataclasses.replace(
        HARDWARE_PRESETS["h800"], name="emulated-cpu", achieved_flops_per_s=1e10,
        h2d_bytes_per_s=5e6, d2h_bytes_per_s=5e6, nvme_read_bytes_per_s=3.125e4,
        nvme_write_bytes_per_s=3.125e4, cpu_optimizer_params_per_s=1.5e7,
        device_runs_async=True)
    p = build_problem(model, hardware)
    budgets = Budgets.from_hardware(
        hardware, gpu_memory_limit_gb=(p.static_gpu_bytes + 8 * p.boundary_bytes) / 0.955 / GIB,
        cpu_memory_limit_gb=(p.static_cpu_bytes + 6 * p.boundary_bytes) / GIB)
    return model, hardware, PlanRequest(budgets=budgets, time_limit_s=10), "d2h"


def _resident_room_bytes(model: ModelProfile, hardware: HardwareProfile) -> int:
    """The device bytes the residents' update on the GPU adds to the static ones."""
    return (build_problem(model, hardware, resident_update="device").static_gpu_bytes
            - build_problem(model, hardware).static_gpu_bytes)


def auto_residents_lost() -> tuple:
    """A drawn problem that a wider, randomized search found (issue 34): tiny Llama,
    D2H-bound, 4 GPU slots plus room for the residents, `resident_update="auto"`. The MIP's
    pick (one boundary recomputed, the residents on the host) leaves no room for the
    residents on the GPU; `checkpoint_all` does, and with them there simulates 0.88x the
    pick. "auto" placed them only after the pick had beaten the baselines (each with its
    residents on the host), so the plan simulated 1.13x `checkpoint_all`'s."""
    model = _model("llama", 5, 2, 64)
    hardware = _hardware(model, "d2h", False, "none", True)
    budgets = budgets_in_slots(model, hardware, gpu_slots=4, cpu_slots=0, nvme_slots=4)
    budgets = dataclasses.replace(
        budgets, gpu_bytes=budgets.gpu_bytes + _resident_room_bytes(model, hardware))
    return model, hardware, PlanRequest(budgets=budgets, max_recompute_block=4, time_limit_s=10,
                                        resident_update="auto"), "d2h"


@st.composite
def problems(draw: st.DrawFn) -> tuple:
    layers = draw(st.integers(3, 6))
    model = _model(draw(st.sampled_from(FAMILIES)), layers, draw(st.sampled_from((2, 4, 8))),
                   draw(st.sampled_from((32, 64, 128))))
    regime = draw(st.sampled_from(REGIMES))
    hardware = _hardware(model, regime, draw(st.booleans()),
                         draw(st.sampled_from(tuple(HOST_WORK))), draw(st.booleans()))
    budgets = budgets_in_slots(model, hardware, gpu_slots=draw(st.integers(3, layers + 2)),
                               cpu_slots=draw(st.integers(0, layers)),
                               nvme_slots=draw(st.integers(0, layers)))
    resident_update = draw(st.sampled_from(("host", "device", "auto")))
    if resident_update != "host":  # room for the residents on the GPU, or some of it
        budgets = dataclasses.replace(budgets, gpu_bytes=budgets.gpu_bytes + int(
            draw(st.sampled_from((0.5, 1.0, 1.1))) * _resident_room_bytes(model, hardware)))
    request = PlanRequest(budgets=budgets, max_recompute_block=draw(st.sampled_from((2, 4))),
                          time_limit_s=10, resident_update=resident_update)
    return model, hardware, request, draw(st.sampled_from(("h2d", "d2h", "nvme")))


def _plan(model: ModelProfile, hardware: HardwareProfile, request: PlanRequest) -> Plan | None:
    try:
        return make_plan(model, hardware, request)
    except PlanInfeasibleError:
        return None


def mispriced(p: Problem, plan: Plan, model: ModelProfile, hardware: HardwareProfile) -> str:
    """The terms of `plan` the MIP's objective prices more than `TOLERANCE` of the step away
    from the simulator's, as a sentence."""
    sim = simulate(plan, model, hardware, include_optimizer=False)
    step_s, sol = sim.step_s, plan.solver
    restream_s = sum(p.restream_host_s(s, e) for s, e in plan.blocks)
    recompute_s = sum(p.block_cost_s(s, e) for s, e in plan.blocks) - restream_s
    # the host's work on the compute's thread (the prologue's staging, the first window's
    # beside layer 1's copy, and the drain too), else on its own lane: exposed where it
    # binds (the prologue and the drain always)
    prologue_host_s = p.stage_s + p.host_window_s({})[0] if p.host_on_compute else 0.0
    host_s = p.host_s + prologue_host_s + restream_s if p.host_on_compute else 0.0
    waits_s = p.prologue_s + p.tail_s - (prologue_host_s if p.host_on_compute
                                         else -p.host_tail_s)
    terms = {"window (compute, recompute, overhead)": (
        p.compute_s + recompute_s, sim.compute_s + sim.recompute_s + sim.overhead_s),
        "host (weights staged, gradients folded)": (host_s, sim.host_s),
        "link (exposure)": (sum(sol.exposed_s) + waits_s, sim.exposed_s),
        "overlap (the host update beside the next step)": (
            0.0, plan.prediction.optimizer_exposed_s)}
    bad = [f"{name}: MIP {mip:.4g} s, simulator {simulated:.4g} s ({sim.exposed_by_link_s})"
           for name, (mip, simulated) in terms.items()
           if abs(mip - simulated) > TOLERANCE * step_s]
    return "; ".join(bad) or "no term (the plans differ by less than the tolerance each)"


def _check_not_slower(plan: Plan, other_s: float, what: str, instance: tuple) -> None:
    model, hardware, request, _ = instance
    mip_s = plan.solver.mip_step_s or plan.prediction.step_s
    assert plan.prediction.step_s <= (1 + TOLERANCE) * other_s, (what, plan.homes)
    if mip_s > (1 + TOLERANCE) * other_s:  # the simulator rescued a bad MIP pick
        p = build_problem(model, hardware, budgets=request.budgets,
                          max_recompute_block=request.max_recompute_block)
        raise AssertionError(f"the MIP's pick simulates {mip_s:.4g} s, {what} {other_s:.4g} "
                             f"s; {plan.solver.message}; {mispriced(p, plan, model, hardware)}")


def test_the_plan_is_never_slower_than_a_plan_the_planner_already_has() -> None:
    checked: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(problems())
    @example(d2h_drift())
    def check(instance: tuple) -> None:
        model, hardware, request, drifting = instance
        plan = _plan(model, hardware, request)
        if plan is None:
            return
        checked.append(1)
        for name in BASELINES:
            baseline = _plan(model, hardware, dataclasses.replace(request, strategy=name))
            # megatrain updates the residents on the host: no alternative where the engine
            # holds them on the GPU (`resident_update="device"`)
            if baseline is not None and request.resident_update in (
                    "auto", baseline.resident_update):
                _check_not_slower(plan, baseline.prediction.step_s, name, instance)
        field = {"h2d": ("h2d_bytes_per_s",), "d2h": ("d2h_bytes_per_s",),
                 "nvme": ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s")}[drifting]
        slowed = dataclasses.replace(hardware, **{f: getattr(hardware, f) / 12 for f in field})
        replanned = _plan(model, slowed, dataclasses.replace(
            request, resident_update=plan.resident_update, running=plan))
        if replanned is not None:
            running_s = simulate(plan, model, slowed).step_s
            _check_not_slower(replanned, running_s, "the running plan",
                              (model, slowed, request, drifting))

    check()
    assert len(checked) >= EXAMPLES // 2, f"only {len(checked)} of {EXAMPLES} planned"


def test_auto_places_the_residents_of_every_candidate_before_they_compete() -> None:
    """The returned plan is within `TOLERANCE` of every baseline planned with "auto". The
    MIP's own pick still loses here (so the property test above does not take this
    instance): with the residents charged to the GPU its capacity row, which charges every
    plan the third weight buffer and the staging boundaries (a layer's weights and two
    boundaries more than the all-GPU plan's simulated peak), admits no plan; docs/planner.md
    "Known limits"."""
    model, hardware, request, _ = auto_residents_lost()
    plan = make_plan(model, hardware, request)
    for name in BASELINES:
        baseline = _plan(model, hardware, dataclasses.replace(request, strategy=name))
        if baseline is not None:
            assert plan.prediction.step_s <= (1 + TOLERANCE) * baseline.prediction.step_s, (
                name, plan.prediction.step_s, baseline.prediction.step_s,
                baseline.resident_update)
