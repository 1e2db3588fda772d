"""Host state on NVMe, measured (issue 44): a ~270M-parameter Llama in bf16 through the
plugin, once with a DRAM budget that holds its host state, once with one too small for its
layers' compute copies, once with one that every copy on NVMe leaves short by some
layers' gradients, and once with one that every copy and gradient there leaves short (the
masters and moments of some layers go too), each in a fresh process.

Prints, per run: the plan's copies, gradients and masters on NVMe, the median step, the plan's
predicted step, the peak RSS growth of `prepare` and the steps against the DRAM budget
(what the run may still allocate: the budget less the model's fp32 weights present before
it), and for the NVMe runs the state's read and write rates against the drive's
`O_DIRECT` probe in the same process, and (a drive that reads and writes in turn) both
directions' bytes over the time it was busy with either against the probe's rates taking
them in turn; then the ratios between the runs and whether their losses are equal bit for
bit. Not a test (this machine's timings move 20-40% between processes).

    PYTHONPATH=. python bench/nvme_state.py [--steps 4] [--nvme-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
BATCH, SEQ, VOCAB, LAYERS = 1, 128, 32000, 16


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=LAYERS, num_attention_heads=16,
                         num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _budget_gb(model, short_copies: float, short_grads: float,
               short_optimizer: float) -> float:
    """The plan's fixed host bytes (all in DRAM) less `short_copies` layers' copies,
    `short_grads` layers' gradients and `short_optimizer` layers' masters and moments."""
    import torch

    from lazytrain_accel.planning.problem import build_problem
    from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
    from lazytrain_accel.run import setup

    profile = setup.profile_for_run(model, batch_size=BATCH, seq_len=SEQ,
                                    compute_dtype=torch.bfloat16)
    p = build_problem(profile, HARDWARE_PRESETS["h800"])
    sizes = p.state_sizes
    return (p.cpu_fixed_bytes - short_copies * sizes.copies_bytes
            - short_grads * sizes.grads_bytes - short_optimizer * sizes.optimizer_bytes) / GIB


def run(workdir: str, cache_dir: str, steps: int, short_copies: float,
        short_grads: float, short_optimizer: float) -> dict:
    """One run in this process (called in a fresh one by `main`)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peak_rss import peak_growth_bytes, start_peak

    from lazytrain_accel import Accelerator, LazyTrainPlugin
    from lazytrain_accel.profiling.measure import _measure_nvme, _measure_nvme_full_duplex

    model = _model()
    budget_gb = (_budget_gb(model, short_copies, short_grads, short_optimizer)
                 if short_copies or short_grads or short_optimizer else 0.0)
    present = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)
    # the update overlapped with the next forward: the path that writes the layers'
    # compute copies (inline, the CPU device's default, casts each load from its masters)
    # one NVMe directory for every run: the cached profile's key names it, so the runs
    # after the first reuse the first's measurement instead of measuring again
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="auto", resident_update="host",
                             cache_dir=cache_dir, nvme_dir=str(Path(workdir).parent / "nvme"),
                             cpu_memory_limit_gb=budget_gb, overlap_step=True)
    acc = Accelerator(cpu=True, mixed_precision="bf16", plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    baseline = start_peak()
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses, step_s = [], []
    for (batch,) in loader:
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        acc.wait_for_everyone()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
    growth = peak_growth_bytes(baseline)
    engine, plan = acc.lazytrain.engine, acc.lazytrain.run.plan
    device_bytes = plan.prediction.peak_gpu_bytes  # the CPU "device": host RAM too
    moved = engine.total_stats()
    acc.end_training()
    Path(f"{workdir}/probe").mkdir(parents=True, exist_ok=True)
    probe_read, probe_write = _measure_nvme(Path(f"{workdir}/probe"), 256 << 20)
    full_duplex = _measure_nvme_full_duplex(Path(f"{workdir}/probe"), 128 << 20)
    rate = {kind: moved.transfer_bytes[kind] / moved.transfer_s[kind]
            if moved.transfer_s[kind] else None
            for kind in ("state_nvme_read", "state_nvme_write", "state_nvme")}
    return {"losses": losses, "step_s": statistics.median(step_s[1:] or step_s),
            "predicted_step_s": plan.prediction.step_s, "copies_on_nvme": len(plan.state.copies),
            "grads_on_nvme": len(plan.state.grads),
            "optimizer_on_nvme": len(plan.state.optimizer),
            "budget_bytes": budget_gb * GIB, "present_bytes": present, "growth_bytes": growth,
            "device_bytes": device_bytes,
            "read_bytes_per_s": rate["state_nvme_read"],
            "write_bytes_per_s": rate["state_nvme_write"],
            "either_bytes_per_s": rate["state_nvme"], "full_duplex": full_duplex,
            "read_bytes": moved.transfer_bytes["state_nvme_read"],
            "write_bytes": moved.transfer_bytes["state_nvme_write"],
            "probe_read_bytes_per_s": probe_read, "probe_write_bytes_per_s": probe_write}


def _fresh(workdir: str, cache_dir: str, steps: int, short_copies: float = 0.0,
           short_grads: float = 0.0, short_optimizer: float = 0.0) -> dict:
    # large blocks from mmap, returned to the system when freed: a dropped copy's bytes
    # leave the resident set (glibc's heap would keep them)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, "--child", workdir, "--cache-dir",
                           cache_dir, "--steps", str(steps), "--short-copies", str(short_copies),
                           "--short-grads", str(short_grads),
                           "--short-optimizer", str(short_optimizer)],
                          capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--short-copies", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--short-grads", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--short-optimizer", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--nvme-dir", default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child, args.cache_dir, args.steps, args.short_copies,
                             args.short_grads, args.short_optimizer)))
        return
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        # one cache: the first run measures this machine, the second reuses the profile
        dram = _fresh(f"{tmp}/dram", f"{tmp}/cache", args.steps)
        copies = _fresh(f"{tmp}/copies", f"{tmp}/cache", args.steps, LAYERS - 4.0)
        grads = _fresh(f"{tmp}/grads", f"{tmp}/cache", args.steps, LAYERS, 4.0)
        # more than every gradient the backward can write: the masters must go too
        masters = _fresh(f"{tmp}/masters", f"{tmp}/cache", args.steps, LAYERS, LAYERS, 4.0)
    print(f"CPU: {_cpu_model()}; {LAYERS} layers, batch {BATCH} x {SEQ}, bf16, "
          f"{args.steps} steps a run")
    runs = (("all in DRAM", dram), ("copies on NVMe", copies),
            ("copies and gradients on NVMe", grads),
            ("copies, gradients, masters and moments on NVMe", masters))
    for name, r in runs:
        line = (f"{name}: {r['copies_on_nvme']} copies, {r['grads_on_nvme']} layers' "
                f"gradients and {r['optimizer_on_nvme']} layers' masters and moments on "
                f"NVMe, step {r['step_s']:.2f} s "
                f"(predicted {r['predicted_step_s']:.2f} s, measured/predicted "
                f"{r['step_s'] / r['predicted_step_s']:.2f}x), peak growth "
                f"{r['growth_bytes'] / GIB:.2f} GiB")
        if r["budget_bytes"]:  # on a CPU device the plan's device bytes are host RAM too
            room = r["budget_bytes"] - r["present_bytes"] + r["device_bytes"]
            line += (f" against {room / GIB:.2f} GiB the budget and the device tier leave "
                     f"({r['growth_bytes'] / room:.3f}x, "
                     f"{(r['growth_bytes'] - room) / 2**20:+.0f} MiB)")
        print(line)
    for name, r in runs[1:]:
        if r["read_bytes_per_s"]:
            print(f"{name}: the state's reads {r['read_bytes_per_s'] / 1e9:.2f} GB/s = "
                  f"{r['read_bytes_per_s'] / r['probe_read_bytes_per_s']:.2f}x the O_DIRECT "
                  f"probe's {r['probe_read_bytes_per_s'] / 1e9:.2f}; writes "
                  f"{r['write_bytes_per_s'] / 1e9:.2f} GB/s = "
                  f"{r['write_bytes_per_s'] / r['probe_write_bytes_per_s']:.2f}x its "
                  f"{r['probe_write_bytes_per_s'] / 1e9:.2f}")
            # a shared drive: both directions' bytes over its busy time, against the
            # probe's rates taking the same bytes in turn
            mix = (r["read_bytes"] + r["write_bytes"]) / (
                r["read_bytes"] / r["probe_read_bytes_per_s"]
                + r["write_bytes"] / r["probe_write_bytes_per_s"])
            print(f"{name}: the drive ({'full' if r['full_duplex'] else 'shared'} duplex, "
                  f"timed here) moved the state at {r['either_bytes_per_s'] / 1e9:.2f} GB/s "
                  f"while busy with either direction = {r['either_bytes_per_s'] / mix:.2f}x "
                  f"the probe's reads and writes in turn ({mix / 1e9:.2f})")
        print(f"{name}: step / all in DRAM {r['step_s'] / dram['step_s']:.2f}x; losses equal "
              f"bit for bit: {r['losses'] == dram['losses']}")


if __name__ == "__main__":
    main()
