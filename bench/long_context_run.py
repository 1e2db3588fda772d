"""One training step on one long sample, in this fresh process; prints JSON (loss, peak
memory growth of the step, step seconds) and saves every gradient to `--grads`.

Modes: `layer` / `tiled` / `untiled` run through the Accelerate plugin (`layer`: the whole
layer in sequence tiles, `Plan.tiling` "layer"; `tiled`: the MLP only, "mlp"; set on the
engine's plan, the fused loss on), `stock` is plain transformers with gradient
checkpointing. Run by `bench/long_context.py` and `tests/frontends/test_long_sample.py`.

Memory: VmHWM (peak resident set, reset through /proc/self/clear_refs) after the step,
minus VmRSS just before it. Beside it, for the plugin modes, the planner's prediction of
that growth (`predicted_growth_bytes`): on a CPU the device is host RAM, so the growth is
one layer's backward working set (`profiling/working_set.py` `layer_working_set`, fp32,
the run's tiles) plus the boundaries the plan keeps through the backward (checkpoint_all:
the L + 1 layer boundaries, [S, hidden] fp32 each). The loss head's working set is not
live with a layer's backward, and the weights, masters and slots predate the step.
A short warm-up step first (kernels, thread pools, the
plugin's plan and weight slots) keeps first-use allocations out of the figure. Run with
MALLOC_MMAP_THRESHOLD_ set (the callers do) so freed tensors leave the resident set.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time

import torch
import transformers
from peak_rss import peak_growth_bytes, start_peak

from lazytrain_accel.profiling.families import geometry_from_config
from lazytrain_accel.profiling.working_set import layer_working_set

VOCAB = 256
WARM_UP_TOKENS = 256


def build_model(seq: int, hidden: int, intermediate: int) -> torch.nn.Module:
    """Two Llama layers whose MLP intermediate dominates, as in real models (two heads of 16
    keep the CPU's attention FLOPs, which grow as seq^2, small; no GQA: the CPU flash
    backward with `enable_gqa` is several times slower, in stock and streamed runs alike)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=seq, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def predicted_growth_bytes(model: torch.nn.Module, seq: int, tile_tokens: int,
                           block_tokens: int = 0) -> int:
    """The planner's peak growth of one step of `model` on one `seq`-token sample through
    the plugin on a CPU (checkpoint_all, fp32; whole-sequence attention, or the whole layer
    in sequence tiles of `block_tokens`)."""
    g = geometry_from_config(model.config.to_dict())
    fp32_bytes = 4
    working = layer_working_set(g, batch_size=1, seq_len=seq, bytes_per_elem=fp32_bytes,
                                weights=None, tile_tokens=tile_tokens,
                                attention_block_tokens=block_tokens)
    kept_boundaries = g.num_layers + 1
    return working.total_bytes + kept_boundaries * seq * g.hidden_size * fp32_bytes


def _prepare(mode: str, model: torch.nn.Module, seq: int, tile_tokens: int, workdir: str):
    """The model to step and a function running backward on a loss."""
    if mode == "stock":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, torch.Tensor.backward
    from lazytrain_accel import Accelerator, LazyTrainPlugin
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", optimizer="keep",
                             loss_chunk_tokens=4096, batch_size=1, seq_len=seq,
                             cache_dir=f"{workdir}/cache", nvme_dir=f"{workdir}/nvme")
    acc = Accelerator(cpu=True, plugin=plugin)
    model = acc.prepare(model)
    engine = acc.lazytrain.engine
    tiling = {"layer": "layer", "tiled": "mlp"}.get(mode, "none")
    engine.set_plan(dataclasses.replace(engine.plan, tiling=tiling,
                                        tile_tokens=0 if tiling == "none" else tile_tokens))
    return model, acc.backward


def run(mode: str, seq: int, tile_tokens: int, hidden: int, intermediate: int,
        grads_path: str | None, workdir: str) -> dict[str, float]:
    model = build_model(seq, hidden, intermediate)
    predicted = (0 if mode == "stock" else
                 predicted_growth_bytes(model, seq, tile_tokens if mode != "untiled" else 0,
                                        tile_tokens if mode == "layer" else 0))
    model, backward = _prepare(mode, model, seq, tile_tokens, workdir)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    warm = ids[:, :WARM_UP_TOKENS]
    backward(model(input_ids=warm, labels=warm).loss)
    model.zero_grad(set_to_none=True)
    gc.collect()
    baseline_bytes = start_peak()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    backward(loss)
    step_s = time.perf_counter() - start
    growth_bytes = peak_growth_bytes(baseline_bytes)
    if grads_path:
        torch.save({n: p.grad for n, p in model.named_parameters()}, grads_path)
    return {"mode": mode, "seq": seq, "loss": float(loss.detach()), "step_s": step_s,
            "peak_growth_bytes": growth_bytes, "predicted_growth_bytes": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("layer", "tiled", "untiled", "stock"),
                        required=True, help="layer: the whole layer in sequence tiles of "
                        "--tile-tokens (and its MLP in tiles of as many); tiled: the MLP "
                        "only; stock reports predicted_growth_bytes 0 (no plan)")
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--tile-tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--grads", default=None, help="save every .grad here (torch.save)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        print(json.dumps(run(args.mode, args.seq, args.tile_tokens, args.hidden,
                             args.intermediate, args.grads, workdir)))


if __name__ == "__main__":
    main()
