"""Several processes on one node: LazyTrain's node store + split update against FSDP2
(issue 22, "bench/node.py"), side by side in one run, on this CPU.

For N = 1, 2, 4 processes (`accelerate launch`; gloo), the same Llama from a config
(46M parameters), the same global batch (split N ways) and the same data, trained by

* `lazytrain`: the plugin, its default optimizer (the hybrid 8-bit AdamW);
* `lazytrain-keep`: the plugin with `optimizer="keep"`: the script's torch AdamW;
* `fsdp2`: `torch.distributed.fsdp.fully_shard` per decoder layer and at the root (no
  offload policy), torch AdamW, the Trainer's usual activation checkpointing per layer
  (HF `gradient_checkpointing_enable`), which is what the plugin's `checkpoint_all` plan
  does: keep each layer's input, recompute its inside in the backward.

Measured per launch:

* host bytes: the ranks' summed PSS (/proc/<pid>/smaps_rollup, shared pages counted once
  across the ranks that map them), sampled from this process every 0.1 s and read by
  each rank after each `optimizer.step()`; the peak of the sum while every rank is in
  its timed steps, and the same less the ranks' runtime
  (their summed PSS after `import torch`, transformers and the process group, before the
  model is built);
* step time: the timed steps' wall time on rank 0, per step (after a warm-up step);
* update time per rank: the optimizer's update of the rank's share, per step (the
  layer-wise update's own time on its thread for the hybrid operator, which overlaps the
  next forward; `optimizer.step()` otherwise), the mean over the ranks;
* for LazyTrain, the ranks' summed peak of the engine's "device" tier (streamed weight
  copies, gradient staging, activation boundaries): on a CPU run the device is this host,
  so those bytes are in the host figure; on a GPU node they would be GPU memory.

Prints a table and, per N, the ratios lazytrain / FSDP2. The issue's bar: host bytes at
most FSDP2's at the same N. Timings on a shared 2-core machine are noisy; the ratios
come from launches of the same run.

    python bench/node.py [--ranks 1 2 4] [--steps 2] [--systems lazytrain lazytrain-keep fsdp2]
    python bench/node.py --ranks 2 --systems lazytrain --bind both   # cores bound vs not

Each rank gets cores // N torch threads (OMP_NUM_THREADS) and a fixed
MALLOC_MMAP_THRESHOLD_ (128 KiB: freed tensors go back to the system, as in the PSS
tests, so the figure is the bytes held, not glibc's retention), both systems alike. A
launch that fails is said and tried once more (`--tries`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peak_rss import pss_bytes  # noqa: E402

SYSTEMS = ("lazytrain", "lazytrain-keep", "fsdp2")
LAUNCH_TIMEOUT_S = 900
SAMPLE_S = 0.1
MB = 1e6


# ---- the worker (one rank) --------------------------------------------------------------
def build_model(args: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def global_batches(args: argparse.Namespace):
    """The same global batches for every system and N: counting sequences."""
    import torch

    g = torch.Generator().manual_seed(1234)
    steps = args.warmup + args.steps
    start = torch.randint(0, args.vocab, (steps, args.global_batch, 1), generator=g)
    return (start + torch.arange(args.seq_len)) % args.vocab


def worker(args: argparse.Namespace) -> None:
    import accelerate  # noqa: F401  (both systems' runtime holds the same libraries)
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM  # noqa: F401

    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    if args.worker == "fsdp2" and not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # one process: a group of one
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(args.port))
        dist.init_process_group("gloo")
    accelerator = None
    if args.worker.startswith("lazytrain"):
        from lazytrain_accel import Accelerator, LazyTrainPlugin

        optimizer_choice = "keep" if args.worker == "lazytrain-keep" else "hybrid8bit"
        accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision,
                                  plugin=LazyTrainPlugin(plan="checkpoint_all",
                                                         optimizer=optimizer_choice))
    world = dist.get_world_size() if dist.is_initialized() else 1
    runtime_pss = pss_bytes()  # imports and the process group, no model yet

    model = build_model(args)
    batches = global_batches(args)
    per_rank = args.global_batch // world
    mine = batches[:, rank * per_rank:(rank + 1) * per_rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
        engine = accelerator.lazytrain.engine

        def backward(loss: torch.Tensor) -> None:
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)

        def synchronize() -> None:
            accelerator.wait_for_everyone()  # the running layer-wise update, then a barrier
    else:
        from torch.distributed.fsdp import fully_shard

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        engine = None

        def backward(loss: torch.Tensor) -> None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        def synchronize() -> None:
            dist.barrier()

    losses, update_s, step_pss = [], [], []
    train_start = time.time()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            if engine is not None:
                engine.reset_stats()
            train_start = time.time()
            update_s, step_pss = [], []
        ids = mine[step]
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        start = time.perf_counter()
        optimizer.step()
        update_s.append(time.perf_counter() - start)
        step_pss.append(pss_bytes())  # the gradients still held
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    synchronize()
    train_end = time.time()
    # what the engine itself counts at its peak per memory tier: on a CPU "device" is
    # this same host memory (on a GPU those bytes would not be the host's)
    tiers = dict(engine.stats().peak_bytes) if engine is not None else {}
    if engine is not None and engine.stats().optimizer_update_s > 0:
        # the hybrid operator's update ran on its thread, overlapped: its own run time
        update_s = [engine.stats().optimizer_update_s / args.steps]
    node_model = node_model_bytes(accelerator) if accelerator is not None else None
    cpus = Path(f"/proc/{os.getpid()}/status").read_text().split("Cpus_allowed_list:")[1]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "threads": torch.get_num_threads(), "cpus_allowed": cpus.split()[0],
        "runtime_pss": runtime_pss, "train_start": train_start, "train_end": train_end,
        "step_s": (train_end - train_start) / args.steps,
        "update_s": sum(update_s) / len(update_s), "losses": losses, "step_pss": step_pss,
        "tiers": tiers, "node_model": node_model,
        "params": sum(p.numel() for p in model.parameters()) if engine is not None
        else sum(p.full_tensor().numel() for p in model.parameters())}))
    if accelerator is not None:
        accelerator.end_training()
    else:
        dist.destroy_process_group()


def node_model_bytes(accelerator) -> int:
    """The node model's host bytes of a node in the running layout at the running plan
    (`planning/layouts.py`, what `lazytrain plan --nodes K` prints), less the term a CPU
    "device" never allocates (the pinned staging a GPU's weights go through): what this
    bench's measured state (the device tier left out) compares with. The gradient
    staging stays: on a CPU device the gradient reduce holds the backward's own outputs
    in its place (the layer being sent and the one landing, as the staging's two slots
    on a GPU)."""
    from lazytrain_accel.planning.host import WEIGHT_STAGING_TERM
    from lazytrain_accel.planning.layouts import layout_figures
    from lazytrain_accel.planning.problem import build_problem

    state = accelerator.lazytrain
    plan, run = state.run.plan, state.run
    figure = layout_figures(plan, run.model_profile, run.hardware, state.budgets)[
        plan.node_layout].host_bytes
    problem = build_problem(run.model_profile, run.hardware, budgets=state.budgets,
                            max_recompute_block=max(e - s for s, e in plan.blocks),
                            resident_update=plan.resident_update, optimizer=plan.optimizer,
                            gpus_per_node=plan.gpus_per_node, nodes=plan.nodes,
                            node_layout=plan.node_layout, state=plan.state)
    staging = sum(b for name, b in problem.cpu_base_terms
                  if name.startswith(WEIGHT_STAGING_TERM))
    return figure - staging


# ---- the launcher -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(system: str, ranks: int, args: argparse.Namespace, workdir: Path, *,
           bind: str = "auto", nodes: int = 1, layout: str = "replicated") -> dict:
    """One launch of `ranks` processes (`bind`: LAZYTRAIN_BIND_CORES) on each of `nodes`
    simulated nodes (one `accelerate launch --machine_rank r` each, holding the state as
    `layout` says); the ranks' results and the summed-PSS samples (per node: `nodes`)."""
    out = workdir / f"{system}-{ranks}-{bind}-{nodes}{layout}"
    out.mkdir(parents=True)
    port = free_port()
    world = ranks * nodes
    model_args = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                  ("hidden", "layers", "vocab", "seq_len", "global_batch", "steps", "warmup",
                   "mixed_precision")]
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads),
           **({"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold
              else {}),
           "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_CACHE_DIR": str(workdir / "cache"),
           "LAZYTRAIN_NVME_DIR": str(workdir / "nvme"), "LAZYTRAIN_BIND_CORES": bind,
           "LAZYTRAIN_NODE_LAYOUT": layout,
           # several nodes: the residents' state with the layers' (the model's host terms);
           # on this CPU "device" their device-side state would be host bytes uncounted
           **({"LAZYTRAIN_RESIDENT_UPDATE": "host"} if nodes > 1 else {})}
    procs = []
    for node in range(nodes):
        if world == 1:
            launcher = ["--cpu", "--num_processes", "1"]
        else:  # accelerate's multi-process CPU mode
            launcher = ["--multi_gpu", "--num_processes", str(world), "--main_process_port",
                        str(port), "--main_process_ip", "127.0.0.1", "--machine_rank",
                        str(node)]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher,
               "--num_machines", str(nodes), "--mixed_precision", "no", "--dynamo_backend",
               "no", __file__, "--worker", system, "--out", str(out), "--port", str(port),
               *model_args]
        log = (out / f"log{node}.txt").open("w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=out), log))
    # (time, summed PSS of each node's ranks) with every rank alive
    samples: list[tuple[float, list[int]]] = []
    deadline = time.time() + LAUNCH_TIMEOUT_S
    while any(proc.poll() is None for proc, _ in procs):
        if time.time() > deadline:
            for proc, _ in procs:
                proc.kill()
            break
        pids = [out / f"pid{r}" for r in range(world)]
        if all(p.is_file() for p in pids):
            try:
                now = time.time()
                pss = [pss_bytes(int(p.read_text())) for p in pids]
                samples.append((now, [sum(pss[n * ranks:(n + 1) * ranks])
                                      for n in range(nodes)]))
            except (OSError, ValueError):  # a rank has just exited
                pass
        time.sleep(SAMPLE_S)
    for node, (proc, log) in enumerate(procs):
        proc.wait()
        log.close()
        if proc.returncode != 0:
            tail = (out / f"log{node}.txt").read_text()[-4000:]
            raise RuntimeError(f"{system} x{ranks} node {node} exited {proc.returncode}:"
                               f"\n{tail}")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    start = max(r["train_start"] for r in results)
    end = min(r["train_end"] for r in results)
    per_node = []
    for n in range(nodes):
        mine = results[n * ranks:(n + 1) * ranks]
        # the sampler's sums inside the timed steps, and each step's sum of the ranks' own
        # readings after `optimizer.step()` (a short run may fall between two samples)
        window = [sums[n] for t, sums in samples if start <= t <= end]
        window += [sum(step) for step in zip(*(r["step_pss"] for r in mine), strict=True)]
        runtime = sum(r["runtime_pss"] for r in mine)
        per_node.append({"host": max(window), "state": max(window) - runtime,
                         "runtime": runtime, "samples": len(window) - args.steps,
                         "device_tier": sum(r["tiers"].get("device", 0) for r in mine),
                         "model": mine[0].get("node_model")})
    row = {"system": system, "ranks": ranks, "bind": bind, "nodes": nodes, "layout": layout,
           **{k: sum(n[k] for n in per_node) for k in ("host", "state", "runtime",
                                                       "device_tier")},
           "samples": min(n["samples"] for n in per_node), "per_node": per_node,
           "threads": [r["threads"] for r in results],
           "cpus": [r["cpus_allowed"] for r in results],
           "step_s": results[0]["step_s"],
           "update_s": sum(r["update_s"] for r in results) / world,
           "loss0": results[0]["losses"][0], "params": results[0]["params"]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                   help="the plugin runs' compute dtype (bf16: the engine streams bf16 "
                   "compute copies; under the split layout a node holds the others' "
                   "layers as those alone)")
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="MALLOC_MMAP_THRESHOLD_ of every rank (0: glibc's dynamic one)")
    p.add_argument("--tries", type=int, default=2, help="launches of a row before it fails")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes of --ranks processes each (LazyTrain only)")
    p.add_argument("--layouts", nargs="+", choices=("replicated", "split"),
                   default=["replicated"], help="LAZYTRAIN_NODE_LAYOUT of multi-node rows")
    p.add_argument("--bind", choices=("auto", "off", "both"), default="auto",
                   help="LAZYTRAIN_BIND_CORES of the LazyTrain ranks; both: each LazyTrain "
                        "row bound and unbound, launched one after the other")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.nodes > 1:
        print_layouts(args)
        return
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lazytrain-node-bench-") as tmp:
        for ranks in args.ranks:
            if args.global_batch % ranks:
                raise SystemExit(f"--global-batch {args.global_batch} does not split {ranks} ways")
            binds = ("auto", "off") if args.bind == "both" else (args.bind,)
            for system, bind in [(s, b) for s in args.systems for b in binds
                                 if s.startswith("lazytrain") or b == binds[0]]:
                row = None
                for attempt in range(1, args.tries + 1):
                    try:
                        row = launch(system, ranks, args, Path(tmp) / str(attempt), bind=bind)
                        break
                    except RuntimeError as err:  # said, then tried again
                        lines = str(err).splitlines()
                        why = [ln for ln in lines if "terminate called" in ln
                               or "exitcode" in ln or "Error" in ln][:4]
                        print(f"{system:15s} N={ranks}: launch {attempt} failed: "
                              f"{lines[0]}; " + " | ".join(w.strip() for w in why),
                              flush=True)
                if row is None:
                    continue
                rows.append(row)
                print(f"{system:15s} N={ranks}: host {row['host'] / MB:7.0f} MB (runtime "
                      f"{row['runtime'] / MB:5.0f}, state {row['state'] / MB:6.0f}), step "
                      f"{row['step_s']:6.2f} s, update/rank {row['update_s']:6.3f} s, first "
                      f"loss {row['loss0']:.4f}" + (
                          f", engine device tier {row['device_tier'] / MB:.0f} MB"
                          if row["device_tier"] else "") + f", bind {bind}: threads "
                      f"{row['threads']}, cores {row['cpus']}", flush=True)
    params = rows[0]["params"]
    print(f"\nLlama {params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} "
          f"layers, vocab {args.vocab}), global batch {args.global_batch} x "
          f"{args.seq_len}, {args.steps} timed steps after {args.warmup}; "
          f"{time.perf_counter() - started:.0f} s in all\n")
    print("| N | system | host MB (summed PSS) | of it state MB | step s | update s/rank |"
          " host vs FSDP2 | state vs FSDP2 | step vs FSDP2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next((r for r in rows if r["system"] == "fsdp2" and r["ranks"] == row["ranks"]),
                    None)
        ratios = ("", "", "") if base is None or row is base else (
            f"{row['host'] / base['host']:.2f}", f"{row['state'] / base['state']:.2f}",
            f"{row['step_s'] / base['step_s']:.2f}")
        label = row["system"] + (" (unbound)" if row["bind"] == "off" else "")
        print(f"| {row['ranks']} | {label} | {row['host'] / MB:.0f} | "
              f"{row['state'] / MB:.0f} | {row['step_s']:.2f} | {row['update_s']:.3f} | "
              + " | ".join(ratios) + " |")
    print_binding(rows)


def print_layouts(args: argparse.Namespace) -> None:
    """LazyTrain over `args.nodes` simulated nodes in each of `args.layouts`: per node,
    the measured state at its peak (the device tier left out) against the node model's."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="lazytrain-node-bench-") as tmp:
        for ranks in args.ranks:
            for layout in args.layouts:
                rows.append(launch("lazytrain", ranks, args, Path(tmp), nodes=args.nodes,
                                   layout=layout))
    print(f"\nLlama {rows[0]['params'] / 1e6:.0f}M parameters (hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}), {args.nodes} simulated nodes, "
          f"global batch {args.global_batch} x {args.seq_len}, {args.steps} timed steps, "
          f"mixed precision {args.mixed_precision}\n")
    print("| ranks/node | layout | node | state MB (peak PSS - runtime - device tier) | "
          "model MB | measured / model |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for n, node in enumerate(row["per_node"]):
            state = node["state"] - node["device_tier"]
            print(f"| {row['ranks']} | {row['layout']} | {n} | {state / MB:.1f} | "
                  f"{node['model'] / MB:.1f} | {state / node['model']:.2f} |")


def print_binding(rows: list[dict]) -> None:
    """Bound against unbound LazyTrain rows of the same N and system (`--bind both`)."""
    pairs = [(r, u) for r in rows if r["bind"] == "auto" for u in rows
             if u["bind"] == "off" and (u["system"], u["ranks"]) == (r["system"], r["ranks"])]
    if not pairs:
        return
    print("\n| N | system | step s bound | step s unbound | bound / unbound | threads per "
          "rank (bound; unbound) | cores per rank (bound; unbound) |")
    print("|---|---|---|---|---|---|---|")
    for bound, free in pairs:
        print(f"| {bound['ranks']} | {bound['system']} | {bound['step_s']:.2f} | "
              f"{free['step_s']:.2f} | {bound['step_s'] / free['step_s']:.2f} | "
              f"{bound['threads']}; {free['threads']} | {bound['cpus']}; {free['cpus']} |")


if __name__ == "__main__":
    main()
