"""`lazytrain plan`, `simulate`, `max-batch`, `max-seq`: the planner from a shell.

`--json` prints one object whose keys are a scripting interface: keep them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from lazytrain_accel import preflight
from lazytrain_accel.cli import CliError, help_of
from lazytrain_accel.cli.args import (
    add_lora_args,
    add_loss_chunk_arg,
    add_node_args,
    fill_from_environment,
    positive_int,
)
from lazytrain_accel.cli.lora import lora_weights
from lazytrain_accel.config import ANONYMOUS_SEGMENT, RESIDENT_UPDATE_CHOICES, env_setting
from lazytrain_accel.planning import (
    STRATEGIES,
    Budgets,
    Home,
    Plan,
    PlanInfeasibleError,
    make_plan,
    max_batch_size,
    simulate,
)
from lazytrain_accel.planning.admission import max_seq_len
from lazytrain_accel.planning.infeasible import with_largest_batch
from lazytrain_accel.planning.layouts import layout_figures
from lazytrain_accel.planning.node import NODE_LAYOUTS
from lazytrain_accel.planning.nvme_traffic import nvme_traffic
from lazytrain_accel.planning.request import HOST_STATES, PlanRequest
from lazytrain_accel.planning.solve import with_device_residents
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.model_configs import (
    COMPUTE_DTYPE_BYTES,
    MODEL_PRESETS,
    geometry_from_config,
    load_model_config,
    profile_model,
)
from lazytrain_accel.profiling.profile import ModelGeometry, ModelProfile
from lazytrain_accel.profiling.working_set import exceeds_int32_index, int32_index_overflow

_GIB = 2**30
MAX_BATCH_SEARCH_LIMIT = 1 << 16
#: `max-seq` searches multiples of this many tokens, up to the limit.
MAX_SEQ_STEP_TOKENS = 1024
MAX_SEQ_SEARCH_LIMIT = 1 << 26


def _add_run_args(p: argparse.ArgumentParser, *, batch: str) -> None:
    """`batch`: "required", "optional" (simulate: a plan file brings it), "none"
    (max-batch) or "one" (max-seq: --batch-size defaults to 1, no --seq-len)."""
    p.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}), "
                   "HF model directory or config .json")
    p.add_argument("--hardware", help="preset (" + ", ".join(HARDWARE_PRESETS)
                   + "), hardware JSON, or 'auto' to measure this machine (default: "
                   "LAZYTRAIN_HARDWARE, else auto)")
    with_plan = " (required unless --plan gives it)" if batch == "optional" else ""
    if batch != "none":
        p.add_argument("--batch-size", type=positive_int, required=batch == "required",
                       default=1 if batch == "one" else None,
                       help="micro-batch size" + (" (default 1)" if batch == "one"
                                                  else with_plan))
    if batch != "one":
        p.add_argument("--seq-len", type=positive_int, required=batch != "optional",
                       help="sequence length" + with_plan)
    # Part of the plan's fingerprint: a plan for bf16 does not fit an fp32 run.
    p.add_argument("--dtype", choices=sorted(COMPUTE_DTYPE_BYTES), default="bf16",
                   help="compute dtype of the run: bf16/fp16 = Accelerator(mixed_precision="
                   "...), fp32 = no mixed precision (default bf16)")
    p.add_argument("--strategy", choices=STRATEGIES, default="lazytrain",
                   help="the MIP (default), its GPU-only variant, or a baseline")
    p.add_argument("--time-limit-s", type=float,
                   help="MIP wall-clock limit; the incumbent is used on timeout (default: "
                   "LAZYTRAIN_SOLVER_TIME_LIMIT_S, else 60)")
    p.add_argument("--max-recompute-block", type=positive_int,
                   help="K, the longest recompute block (default: "
                   "LAZYTRAIN_MAX_RECOMPUTE_BLOCK, else 8)")
    add_loss_chunk_arg(p, default=None, allow_auto=True)
    p.add_argument("--resident-update", choices=RESIDENT_UPDATE_CHOICES,
                   help="where the embeddings', final norm's and head's update runs: auto "
                   "(the planner's choice: on the GPU where it fits and is faster), host or "
                   "device (default: LAZYTRAIN_RESIDENT_UPDATE, else auto)")
    add_lora_args(p)
    add_node_args(p)
    p.add_argument("--node-layout", choices=("auto", *NODE_LAYOUTS), default="auto",
                   help="how the host state spreads over --nodes: split (each node holds "
                   "every layer's compute copy and 1/K of the masters, moments and "
                   "gradients), replicated (each node holds all of it); auto: split over "
                   "several nodes (default auto)")
    for flag, what, env in (("--gpu-memory-gb", "GPU", "GPU_MEMORY_LIMIT_GB"),
                            ("--cpu-memory-gb", "host DRAM", "CPU_MEMORY_LIMIT_GB"),
                            ("--nvme-gb", "NVMe", "NVME_LIMIT_GB")):
        p.add_argument(flag, type=float,
                       help=f"{what} budget in GiB (default: LAZYTRAIN_{env}, else 0 = the "
                       "hardware profile's)")
    p.add_argument("--nvme-drives", type=positive_int, default=1,
                   help="this many of the profile's NVMe drives (a RAID-0 mount, or one "
                   "nvme_dir per drive): its NVMe rates and drive count times this "
                   "(default 1: the profile as it is)")
    p.add_argument("--host-state", choices=HOST_STATES, default="auto",
                   help="where the layers' host state may live when DRAM cannot hold it: "
                   "auto (the planner decides every part), streamed (the parts a run streams "
                   "today: compute copies and gradients), copies, dram, or a baseline "
                   "(default auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(name, help=help_of(name), description=help_of(name) + ".")
    if name == "simulate":
        p.add_argument("--plan", metavar="PLAN.json",
                       help="a plan from `lazytrain plan --output` (batch and sequence "
                       "length come from it); without it, plan first with the same options")
        p.add_argument("--timeline", metavar="OUT.png", help="draw the step as a PNG")
        p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace")
    _add_run_args(p, batch={"plan": "required", "simulate": "optional",
                            "max-seq": "one"}.get(name, "none"))
    if name == "plan":
        p.add_argument("--output", metavar="PLAN.json", help="write the plan as JSON")


def _need(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) is None]
    if missing:
        raise CliError(f"missing {', '.join(missing)} (or --plan); see `lazytrain "
                       f"{args.command} --help`", exit_code=2)


def _load(args: argparse.Namespace) -> tuple[dict, HardwareProfile, Budgets]:
    try:
        config = load_model_config(args.model)
        hardware = load_hardware(args.hardware, cache_dir=env_setting("cache_dir"),
                                 nvme_dir=env_setting("nvme_dir"))
        hardware = with_drives(hardware, args.nvme_drives)
        budgets = Budgets.from_hardware(hardware, args.gpu_memory_gb, args.cpu_memory_gb,
                                        args.nvme_gb)
    except (ValueError, OSError) as err:  # unknown presets, unreadable files: inputs
        raise CliError(str(err), exit_code=2) from None
    return config, hardware, budgets


def with_drives(hardware: HardwareProfile, drives: int) -> HardwareProfile:
    """`hardware` with `drives` of its NVMe drive striped: its rates times `drives` (an
    upper bound: Ratel measured 1 / 3 / 6 / 12 drives give 37.5 / 81.1 / 121.7 / 142
    TFLOPS, docs/user_guide.md "When the state is larger than RAM")."""
    if drives == 1:
        return hardware
    return dataclasses.replace(
        hardware, name=f"{hardware.name} x{drives} NVMe",
        nvme_read_bytes_per_s=drives * hardware.nvme_read_bytes_per_s,
        nvme_write_bytes_per_s=drives * hardware.nvme_write_bytes_per_s,
        nvme_bytes=drives * hardware.nvme_bytes, nvme_drives=drives * hardware.nvme_drives,
        source=f"{hardware.source}; {drives} times its drives striped: NVMe rates and "
               f"capacity x {drives}")


def _profile(config: dict, args: argparse.Namespace, batch_size: int,
             seq_len: int) -> ModelProfile:
    geometry, weights = lora_weights(geometry_from_config(config, name=args.model), args)
    return profile_model(geometry, batch_size=batch_size, seq_len=seq_len,
                         compute_bytes_per_elem=COMPUTE_DTYPE_BYTES[args.dtype],
                         loss_chunk_tokens=args.loss_chunk_tokens, weights=weights,
                         tile_tokens=None)


def _summary(plan: Plan, numbers: Any, geometry: ModelGeometry) -> dict[str, Any]:
    """The printed figures: `numbers` is the plan's prediction (itself one simulated step)
    or a fresh simulation of it, which give the same values."""
    counts = plan.count_homes()
    overflow = int32_index_overflow(geometry, batch_size=plan.batch_size, seq_len=plan.seq_len,
                                    tile_tokens=plan.tile_tokens,
                                    attention_block_tokens=plan.attention_block_tokens)
    return {
        "strategy": plan.strategy, "batch_size": plan.batch_size, "seq_len": plan.seq_len,
        "step_s": numbers.step_s, "tokens_per_s": numbers.tokens_per_s,
        "tflops": numbers.tflops, "peak_gpu_bytes": numbers.peak_gpu_bytes,
        "peak_cpu_bytes": numbers.peak_cpu_bytes, "peak_nvme_bytes": numbers.peak_nvme_bytes,
        "exposed_s": numbers.exposed_s, "exposed_by_link_s": numbers.exposed_by_link_s,
        "recompute_s": numbers.recompute_s, "solve_s": plan.solver.solve_s,
        "gap": plan.solver.gap, "status": plan.solver.status,
        "homes": {h: counts[h] for h in ("gpu", "cpu", "nvme")},
        "recomputed": counts[Home.RECOMPUTE.value],
        "blocks": [list(b) for b in plan.blocks if b[1] - b[0] >= 2],
        "optimizer_exposed_s": numbers.optimizer_exposed_s,
        "loss_chunk_tokens": plan.loss_chunk_tokens,
        "resident_update": plan.resident_update,
        "tiling": plan.tiling,
        "tile_tokens": plan.tile_tokens,
        "layers_run_whole": geometry.whole_layer_reason,
        "int32_index_exceeded": overflow is not None,
        "int32_index_overflow": overflow,
        "hidden_state_past_int32": exceeds_int32_index(
            tokens=plan.batch_size * plan.seq_len, width=geometry.hidden_size),
        "gpus_per_node": plan.gpus_per_node, "nodes": plan.nodes,
        "node_tokens_per_s": plan.gpus_per_node * numbers.tokens_per_s,
        "state_nvme_layers": {part: len(layers) for part, layers
                              in plan.state.to_dict().items()},
    }


def _traffic_summary(plan: Plan, model: ModelProfile, hardware: HardwareProfile
                     ) -> dict[str, Any]:
    t = nvme_traffic(plan, model, hardware)
    return {"nvme_read_bytes": t.read_bytes, "nvme_written_bytes": t.written_bytes,
            "nvme_busy_s": t.busy_s, "nvme_bandwidth_share": t.bandwidth_share,
            "nvme_added_s": t.drive_added_s, "floor_s": t.floor_s,
            "ordered_floor_s": t.ordered_floor_s,
            "nvme_drives": hardware.nvme_drives,
            "nvme_read_bytes_per_s": hardware.nvme_read_bytes_per_s,
            "nvme_write_bytes_per_s": hardware.nvme_write_bytes_per_s,
            "step_over_floor": plan.prediction.step_s / t.floor_s}


def _print(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    homes = summary["homes"]
    print(f"{summary['strategy']}: batch {summary['batch_size']} x seq {summary['seq_len']}, "
          f"step {summary['step_s']:.3f} s, {summary['tokens_per_s']:.1f} tokens/s, "
          f"{summary['tflops']:.1f} TFLOPS (6*params*tokens/step)")
    print(f"  boundaries: {homes['gpu']} GPU, {homes['cpu']} CPU, {homes['nvme']} NVMe, "
          f"{summary['recomputed']} recomputed; recompute {summary['recompute_s']:.3f} s, "
          f"exposed {summary['exposed_s']:.3f} s (optimizer "
          f"{summary['optimizer_exposed_s']:.3f} s of it)")
    chunk = summary["loss_chunk_tokens"]
    print("  loss head: " + (f"fused chunked loss, {chunk} tokens per chunk (training "
                             "outputs carry no logits)" if chunk else "the model's own loss"))
    _print_tiles(summary)
    print("  optimizer: " + ("embeddings, final norm and head updated on the GPU (their "
                             "masters and 8-bit state live there), the layers on the host"
                             if summary["resident_update"] == "device"
                             else "every update on the host"))
    print(f"  peaks: GPU {summary['peak_gpu_bytes'] / _GIB:.2f} GiB, CPU "
          f"{summary['peak_cpu_bytes'] / _GIB:.2f} GiB, NVMe "
          f"{summary['peak_nvme_bytes'] / _GIB:.2f} GiB")
    _print_state(summary)
    print(f"  solver: {summary['status']}, {summary['solve_s']:.2f} s, gap "
          f"{summary['gap']:.2%}")
    _print_node(summary)
    if "megatrain_tflops" in summary:
        mega = summary["megatrain_tflops"]
        print("  vs megatrain in the same budgets: " + (
            f"{mega:.1f} TFLOPS, {summary['tflops'] / mega:.3f}x" if mega else
            "it does not fit"))
        given = summary.get("megatrain_device_residents_tflops")
        if mega and given:
            print(f"    (megatrain updates every parameter on the host, as MegaTrain does; "
                  f"given the residents' GPU update too: {given:.1f} TFLOPS, "
                  f"{summary['tflops'] / given:.3f}x)")


def _print_state(summary: dict[str, Any]) -> None:
    """The host state's NVMe homes, the step's NVMe traffic and the floor, and the state
    baselines beside the plan."""
    on_nvme = summary["state_nvme_layers"]
    if any(on_nvme.values()):
        print(f"  host state on NVMe (layers): masters and moments {on_nvme['optimizer']}, "
              f"gradients {on_nvme['grads']}, compute copies {on_nvme['copies']}; the rest "
              "in DRAM")
    if summary.get("nvme_read_bytes"):
        print(f"  NVMe per step: {summary['nvme_read_bytes'] / 1e9:.1f} GB read, "
              f"{summary['nvme_written_bytes'] / 1e9:.1f} GB written on "
              f"{summary['nvme_drives']} drive(s) at "
              f"{summary['nvme_read_bytes_per_s'] / 1e9:.1f} / "
              f"{summary['nvme_write_bytes_per_s'] / 1e9:.1f} GB/s, drives busy "
              f"{summary['nvme_busy_s']:.1f} s ({summary['nvme_bandwidth_share']:.0%} of the "
              f"step), adding {summary['nvme_added_s']:.1f} s; floor {summary['floor_s']:.1f} "
              f"s (compute or drives), step {summary['step_over_floor']:.2f}x the floor")
        ordered_s = summary["ordered_floor_s"]
        if ordered_s > summary["floor_s"]:
            print(f"    the update reads its state after the backward (the clip needs every "
                  f"gradient): backward and update reads take {ordered_s:.1f} s, step "
                  f"{summary['step_s'] / ordered_s:.2f}x that")
    for name, step_s in summary.get("host_state_baselines", {}).items():
        print(f"  vs host state {name}: " + (f"step {step_s:.1f} s, "
                                             f"{step_s / summary['step_s']:.3f}x this plan's"
                                             if step_s else "it does not fit"))


def _print_tiles(summary: dict[str, Any]) -> None:
    tiling, tile = summary["tiling"], summary["tile_tokens"]
    whole = summary.get("layers_run_whole")
    if tiling == "layer" and whole:
        print(f"  layers: run whole ({whole}), attention in query blocks of {tile} tokens, "
              f"its MLP in tiles of {tile} tokens")
    elif tiling == "layer":
        print(f"  layers: the whole layer in sequence tiles of {tile} tokens (attention as "
              "query blocks against the key prefix)")
    else:
        print("  layers: " + (f"token-wise parts in tiles of {tile} tokens" if tiling == "mlp"
                              else "untiled") + ", attention over the whole sequence")
    if summary["int32_index_exceeded"]:
        print(f"  index: {summary['int32_index_overflow']} reach 2^31 elements: the engine "
              "refuses the run (int32 index math in kernels)")
    elif summary["hidden_state_past_int32"]:
        print("  index: batch x seq x hidden reaches 2^31 elements; the sequence tiles keep "
              "every kernel's tensors below it")


def _print_node(summary: dict[str, Any]) -> None:
    """The node's figures, beside N GPUs each alone on such a host (`one_gpu_*`)."""
    n, k = summary["gpus_per_node"], summary["nodes"]
    if n == 1 and k == 1:
        return
    line = (f"  node: {n} GPUs sharing one host copy, {summary['node_tokens_per_s']:.1f} "
            f"tokens/s per node")
    if "one_gpu_tokens_per_s" in summary:
        one = summary["one_gpu_tokens_per_s"]
        line += (f" vs {n} x one GPU alone on the host {n * one:.1f} tokens/s "
                 f"({summary['node_tokens_per_s'] / (n * one):.3f}x)" if one else
                 " (one GPU alone does not fit these budgets)")
    print(line)
    if "one_gpu_peak_cpu_bytes" in summary:
        one_cpu = summary["one_gpu_peak_cpu_bytes"]
        print(f"  host per node: {summary['peak_cpu_bytes'] / _GIB:.2f} GiB (one GPU alone: "
              f"{one_cpu / _GIB:.2f} GiB; {n} copies would need {n * one_cpu / _GIB:.2f} GiB)")
    if "node_store_bytes" in summary and summary.get("node_layout") != "split":
        print(_store_line(summary))
    if k > 1:
        _print_layouts(summary)


#: What each layout keeps on a node, as `_print_layouts` says it.
_LAYOUT_WORDS = {"split": "every layer's compute copy, 1/{k} of the masters, moments and "
                          "gradients",
                 "replicated": "all of the state"}


def _print_layouts(summary: dict[str, Any]) -> None:
    """The plan's layout across nodes, then the other, each with its host bytes per node
    and network bytes per step (`planning/layouts.py`)."""
    k, layouts, budget = summary["nodes"], summary["node_layouts"], summary["cpu_budget_bytes"]
    chosen = summary["node_layout"]
    for name in (chosen, *[n for n in layouts if n != chosen]):
        f = layouts[name]
        label = "layout" if name == chosen else "vs"
        words = _LAYOUT_WORDS[name].format(k=k)
        host = f"host {f['host_bytes'] / _GIB:.2f} GiB per node ({words})"
        if not f["fits"]:
            host += f", over the {budget / _GIB:.2f} GiB budget: refused"
        net = (f"network {f['network_bytes'] / 1e12:.3f} TB per node per step, "
               f"{f['network_s']:.2f} s at {summary['internode_bytes_per_s'] / 1e9:.0f} GB/s")
        print(f"  {label} {name}: {host}; {net}")
    step_s = summary["step_s"]
    f = layouts[chosen]
    pace = (f"the network within the {step_s:.2f} s step" if f["network_s"] <= step_s else
            f"the network's {f['network_s']:.2f} s per step bounds it")
    print(f"  job: {k} nodes, {summary['job_tokens_per_s']:.1f} tokens/s ({pace})")
    if chosen == "split":
        print("  (a run takes it with LazyTrainPlugin(node_layout='split'))")


def _store_line(summary: dict[str, Any]) -> str:
    """The node store's bytes beside the free bytes of what holds them (node_store_dir)."""
    need, free = summary["node_store_bytes"], summary["shm_free_bytes"]
    line = f"  node store: {need / _GIB:.2f} GiB of shared memory, "
    if summary["node_store_dir"] == ANONYMOUS_SEGMENT:
        return line + (f"anonymous (memfd): host memory bounds it, not {preflight.SHM_DIR} "
                       f"({free / _GIB:.2f} GiB free here)")
    line += f"in {summary['node_store_dir']} ({free / _GIB:.2f} GiB free here"
    return line + ("; too small: each rank would keep its own copy)" if need > free else ")")


def _request(args: argparse.Namespace, budgets: Budgets, **changes: Any) -> PlanRequest:
    """The plan request the CLI flags make (--strategy, --max-recompute-block, ...),
    with `changes` over them."""
    return PlanRequest(**{"strategy": args.strategy, "budgets": budgets,
                          "max_recompute_block": args.max_recompute_block,
                          "time_limit_s": args.time_limit_s,
                          "resident_update": args.resident_update,
                          "gpus_per_node": args.gpus_per_node, "nodes": args.nodes,
                          "node_layout": args.node_layout, "host_state": args.host_state,
                          **changes})


def _make(args: argparse.Namespace, config: dict, hardware: HardwareProfile,
          budgets: Budgets) -> tuple[Plan, ModelProfile]:
    _need(args, "batch_size", "seq_len")
    model = _profile(config, args, args.batch_size, args.seq_len)
    request = _request(args, budgets)
    try:
        plan = make_plan(model, hardware, request)
    except PlanInfeasibleError as err:  # say what would fit, not only what does not
        raise with_largest_batch(err, lambda b: _profile(config, args, b, args.seq_len),
                                 hardware, request, batch_size=args.batch_size,
                                 seq_len=args.seq_len) from None
    return plan, model


def _plan_or_none(model: ModelProfile, hardware: HardwareProfile,
                  request: PlanRequest) -> Plan | None:
    """`make_plan`, or None when it does not fit (a comparison's other side: no elastic
    re-solve names the refusal's shortfall, `diagnose_s=0`, since nothing reads it)."""
    try:
        return make_plan(model, hardware, dataclasses.replace(request, diagnose_s=0.0))
    except PlanInfeasibleError:
        return None


def _layout_summary(plan: Plan, model: ModelProfile, hardware: HardwareProfile,
                    budgets: Budgets) -> dict[str, Any]:
    """Over several nodes, both layouts' host bytes per node and network per step
    (`planning/layouts.py`); nothing on one node."""
    if plan.nodes == 1:
        return {}
    figures = layout_figures(plan, model, hardware, budgets)
    return {"node_layout": plan.node_layout, "cpu_budget_bytes": budgets.cpu_bytes,
            "internode_bytes_per_s": hardware.internode_bytes_per_s,
            "job_tokens_per_s": figures[plan.node_layout].job_tokens_per_s(plan),
            "node_layouts": {n: dataclasses.asdict(f) for n, f in figures.items()}}


def _run_plan(args: argparse.Namespace) -> int:
    config, hardware, budgets = _load(args)
    plan, model = _make(args, config, hardware, budgets)
    if args.output:
        plan.save(args.output)
    summary = _summary(plan, plan.prediction, model.geometry)
    summary.update(_traffic_summary(plan, model, hardware))
    if plan.state.any:  # the state baselines, in the same budgets
        dram = _plan_or_none(model, hardware, _request(args, budgets, host_state="dram"))
        priced_s = plan.solver.state_steps_s  # the candidates `make_plan` priced
        summary["host_state_baselines"] = {
            "dram": None if dram is None else dram.prediction.step_s,
            "greedy": priced_s.get("greedy"), "all_nvme": priced_s.get("all_nvme")}
    if args.strategy != "megatrain":  # the paper's comparison, in the same budgets
        mega = _plan_or_none(model, hardware, _request(
            args, budgets, strategy="megatrain", resident_update="auto"))
        summary["megatrain_tflops"] = None if mega is None else mega.prediction.tflops
        given = (None if mega is None or plan.resident_update == "host"
                 else with_device_residents(mega, model, hardware, budgets))
        if given is not None:  # the same optimizer placement, for a like-for-like figure
            summary["megatrain_device_residents_tflops"] = given.prediction.tflops
    summary.update(_layout_summary(plan, model, hardware, budgets))
    if args.gpus_per_node > 1:  # the same GPUs, each alone on such a host
        one = _plan_or_none(model, hardware, _request(args, budgets, gpus_per_node=1,
                                                      nodes=1))
        summary["one_gpu_tokens_per_s"] = None if one is None else one.prediction.tokens_per_s
        summary["one_gpu_peak_cpu_bytes"] = (None if one is None
                                             else one.prediction.peak_cpu_bytes)
        store_dir = env_setting("node_store_dir")
        summary.update(node_store_bytes=preflight.node_store_bytes(model),
                       node_store_dir=store_dir, shm_free_bytes=preflight.shm_free_bytes(
                           preflight.SHM_DIR if store_dir == ANONYMOUS_SEGMENT else store_dir))
    _print(summary, args.json)
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    if args.plan:
        config, hardware, budgets = _load(args)
        plan = Plan.load(args.plan)
        model = _profile(config, args, plan.batch_size, plan.seq_len)
    else:
        loaded = _load(args)
        hardware, budgets = loaded[1], loaded[2]
        plan, model = _make(args, *loaded)
    result = simulate(plan, model, hardware)
    if args.timeline or args.trace:
        from lazytrain_accel.planning import timeline

        if args.timeline:
            timeline.draw_timeline(result, args.timeline, budgets=budgets)
        if args.trace:
            timeline.save_chrome_trace(result, args.trace)
    summary = _summary(plan, result, model.geometry)
    summary.update(_layout_summary(plan, model, hardware, budgets))
    summary["predicted_step_s"] = plan.prediction.step_s
    _print(summary, args.json)
    return 0


def _run_max_batch(args: argparse.Namespace) -> int:
    config, hardware, budgets = _load(args)
    best = max_batch_size(lambda b: _profile(config, args, b, args.seq_len), hardware,
                          _request(args, budgets), limit=MAX_BATCH_SEARCH_LIMIT)
    # The search stops at its limit: there, the budgets were never binding.
    at_limit = best >= MAX_BATCH_SEARCH_LIMIT
    if args.json:
        print(json.dumps({"strategy": args.strategy, "max_batch_size": best,
                          "seq_len": args.seq_len, "search_limit_reached": at_limit}))
    elif at_limit:
        print(f"{args.strategy}: every micro-batch up to the search limit {best} fits at seq "
              f"{args.seq_len} (the budgets never bind)")
    else:
        print(f"{args.strategy}: largest micro-batch at seq {args.seq_len} is {best}")
    return 0


def _run_max_seq(args: argparse.Namespace) -> int:
    config, hardware, budgets = _load(args)
    request = _request(args, budgets)
    best = max_seq_len(lambda s: _profile(config, args, args.batch_size, s), hardware,
                       request, step_tokens=MAX_SEQ_STEP_TOKENS,
                       limit_tokens=MAX_SEQ_SEARCH_LIMIT)
    model = _profile(config, args, args.batch_size, best)
    plan = make_plan(model, hardware, request)
    summary = {**_summary(plan, plan.prediction, model.geometry),
               "max_seq_len": best, "step_tokens": MAX_SEQ_STEP_TOKENS,
               "search_limit_reached": best >= MAX_SEQ_SEARCH_LIMIT}
    if args.json:
        print(json.dumps(summary))
        return 0
    homes = summary["homes"]
    limit = " (the search limit: the budgets never bind)" if summary[
        "search_limit_reached"] else ""
    print(f"{args.strategy}: longest sequence at batch {args.batch_size} is {best} tokens"
          f"{limit} (searched in steps of {MAX_SEQ_STEP_TOKENS}); predicted step "
          f"{plan.prediction.step_s:.1f} s")
    print(f"  boundaries: {homes['gpu']} GPU, {homes['cpu']} CPU, {homes['nvme']} NVMe, "
          f"{summary['recomputed']} recomputed")
    _print_tiles(summary)
    print(f"  peaks: GPU {summary['peak_gpu_bytes'] / _GIB:.2f} GiB, CPU "
          f"{summary['peak_cpu_bytes'] / _GIB:.2f} GiB, NVMe "
          f"{summary['peak_nvme_bytes'] / _GIB:.2f} GiB")
    return 0


def run(args: argparse.Namespace) -> int:
    runner = {"plan": _run_plan, "simulate": _run_simulate, "max-batch": _run_max_batch,
              "max-seq": _run_max_seq}
    try:
        fill_from_environment(args)  # LAZYTRAIN_* for flags left out
        return runner[args.command](args)
    except ValueError as err:  # infeasible budgets, bad plan files, bad values: inputs
        raise CliError(str(err), exit_code=2) from None
    except OSError as err:
        raise CliError(f"cannot read or write a file: {err}") from None
