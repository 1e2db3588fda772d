"""One bf16 run through the plugin on CPU, planned at 95% of a host budget; prints what it
planned and the peak RSS growth it measured, as JSON (`test_host_budget.py` runs it in a
fresh process so nothing earlier in the test session is counted).

What is counted: VmHWM (peak resident set, reset through /proc/self/clear_refs) after two
optimizer steps, minus VmRSS just before `prepare`. The baseline already holds the torch
runtime (warmed up by a throwaway bf16 forward, backward and AdamW step), the model's fp32
weights (the plan's `present_bytes`) and the data loader, so the growth is what `prepare`
and the steps allocate: the host tier and, on a CPU run, the "device" tier as well (the
weight slots, activations and working sets live in the same RAM).
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin, preflight
from lazytrain_accel.planning.problem import build_problem
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.run import setup

# the same /proc reader as the benchmarks' (bench/peak_rss.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peak_rss import peak_growth_bytes, start_peak

GIB = 2**30
BATCH, SEQ, VOCAB = 2, 64, 1024
#: Share of the host budget the plan's fixed host terms fill.
FILL = 0.95


def _model(hidden: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=SEQ, use_cache=False)
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config)


def _warm_up_torch() -> None:
    """The torch runtime's first-use allocations (kernels, thread pools) before the
    baseline: a small model's bf16 forward, backward and AdamW step."""
    model = _model(64)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()


def main(workdir: str) -> dict[str, float]:
    _warm_up_torch()
    model = _model(1024)
    ids = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)
    hardware = load_hardware("h800")
    profile = setup.profile_for_run(model, batch_size=BATCH, seq_len=SEQ,
                                    compute_dtype=torch.bfloat16)
    fixed_bytes = build_problem(profile, hardware).cpu_fixed_bytes
    plugin = LazyTrainPlugin(hardware="h800", cache_dir=f"{workdir}/cache",
                             nvme_dir=f"{workdir}/nvme", resident_update="host",
                             cpu_memory_limit_gb=fixed_bytes / FILL / GIB)
    acc = Accelerator(cpu=True, mixed_precision="bf16", plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    baseline_bytes = start_peak()
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    acc.wait_for_everyone()  # the last layer-wise update has written its state
    growth_bytes = peak_growth_bytes(baseline_bytes)
    run = acc.lazytrain.run
    estimate = preflight.estimate_host_bytes(
        model_profile=run.model_profile, plan=run.plan, optimizer="hybrid8bit",
        present_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    acc.end_training()
    return {"budget_bytes": plugin.cpu_memory_limit_gb * GIB,
            "planned_host_bytes": estimate.total_bytes, "present_bytes": estimate.present_bytes,
            "planned_new_host_bytes": estimate.new_bytes,
            "planned_gpu_bytes": run.plan.prediction.peak_gpu_bytes,
            "growth_bytes": growth_bytes, "terms": dict(estimate.terms)}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(main(sys.argv[1] if len(sys.argv) > 1 else tmp), sys.stdout)
