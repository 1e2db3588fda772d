"""The host state across nodes (issue 45): 405B on nodes of 8 H200s with 2 TB of host,
planned split and replicated, beside ZeRO-3 and FSDP2's host bytes per node.

For K = 4 and 8 nodes: `make_plan` with the split layout (the planner's model, no run;
where it is refused, planned without the host budget for its figures), its host bytes per
node and network bytes per step for both layouts
(`planning/layouts.py`), and the anchors' host bytes per node from their own rules:
ZeRO-3 with CPU offload, DeepSpeed's `estimate_zero3_model_states_mem_needs` (18 bytes per
parameter with its 1.5x buffer, over the K nodes); FSDP2 with `CPUOffloadPolicy`, full
shard (16 bytes per parameter: fp32 parameters, gradients and two Adam moments, over the
K nodes). Their network: three collectives of 2P bytes per GPU per micro-batch (ZeRO-3's
all-gathers in the forward and the backward and the gradients' reduce-scatter), what
each of the node's 8 GPUs sends, not only across nodes.

    python bench/node_layouts.py [--nodes 4 8] [--cpu-memory-gb 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan
from lazytrain_accel.planning.layouts import layout_figures
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)

GIB = 2**30
TB = 1e12
GPUS_PER_NODE = 8
ZERO3_BYTES_PER_PARAM = 18 * 1.5
FSDP2_BYTES_PER_PARAM = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--cpu-memory-gb", type=float, default=2048)
    args = p.parse_args()
    name = "llama3.1-405b"
    model = profile_model(geometry_from_config(load_model_config(name), name=name),
                          batch_size=1, seq_len=4096, compute_bytes_per_elem=2)
    h200 = HARDWARE_PRESETS["h200"]
    budgets = dataclasses.replace(Budgets.from_hardware(h200),
                                  cpu_bytes=int(args.cpu_memory_gb * GIB))
    params = model.geometry.total_param_count
    print(f"{name}: {params / 1e9:.1f}B parameters, batch 1 x 4096 per GPU, "
          f"{GPUS_PER_NODE} x h200 a node, host budget {args.cpu_memory_gb:.0f} GiB, "
          f"network {h200.internode_bytes_per_s / 1e9:.0f} GB/s a node\n")
    print("| K | system | host TB per node | fits | network TB per node per step | "
          "vs split host |")
    print("|---|---|---|---|---|---|")
    for nodes in args.nodes:
        request = PlanRequest(gpus_per_node=GPUS_PER_NODE, nodes=nodes, budgets=budgets,
                              time_limit_s=5.0)
        try:
            plan = make_plan(model, h200, request)
        except PlanInfeasibleError:  # its figures as planned without the host budget
            plan = make_plan(model, h200, dataclasses.replace(request, budgets=dataclasses.replace(
                budgets, cpu_bytes=2**50)))
        figures = layout_figures(plan, model, h200, budgets)
        split = figures["split"].host_bytes
        try:
            make_plan(model, h200, dataclasses.replace(request, node_layout="replicated",
                                                       diagnose_s=0.0))
            refused = "plans"
        except PlanInfeasibleError:
            refused = "refused"
        world = nodes * GPUS_PER_NODE
        anchors_net = GPUS_PER_NODE * 3 * 2 * params * (world - 1) / world
        rows = [("lazytrain split", split, "plans" if figures["split"].fits else "refused",
                 figures["split"].network_bytes),
                ("lazytrain replicated", figures["replicated"].host_bytes, refused,
                 figures["replicated"].network_bytes),
                ("ZeRO-3 CPU offload", ZERO3_BYTES_PER_PARAM * params / nodes,
                 "", anchors_net),
                ("FSDP2 CPUOffloadPolicy", FSDP2_BYTES_PER_PARAM * params / nodes,
                 "", anchors_net)]
        for system, host, fits, net in rows:
            print(f"| {nodes} | {system} | {host / TB:.2f} | {fits} | {net / TB:.2f} | "
                  f"{host / split:.2f} |")
        print(f"|   | (split plan: step {plan.prediction.step_s:.1f} s, network "
              f"{figures['split'].network_s:.1f} s of it overlapped, job "
              f"{figures['split'].job_tokens_per_s(plan):.0f} tokens/s) |  |  |  |  |")


if __name__ == "__main__":
    main()
