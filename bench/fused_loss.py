"""CPU step time and peak memory of the fused chunked loss vs HF's own loss.

Two identical copies of a small Qwen2 with a large vocabulary (default 65,536: the head
and its logits dominate), same process, alternating training steps (forward + backward);
one copy computes HF's loss (full tokens x vocab logits), the other the fused chunked loss
(`apply_fused_loss`). Prints the median step-time ratio and the peak RSS growth of each
variant during its step (Linux: VmHWM reset through /proc/self/clear_refs before each
step). Usage: python bench/fused_loss.py [--steps 4] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers
from peak_rss import peak_growth_bytes, start_peak

from lazytrain_accel.engine import apply_fused_loss


def timed_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor
               ) -> tuple[float, int]:
    """(seconds, peak RSS growth bytes) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    start_bytes = start_peak()
    start = time.perf_counter()
    model(input_ids=ids, labels=labels).loss.backward()
    seconds = time.perf_counter() - start
    return seconds, peak_growth_bytes(start_bytes)


def build(args: argparse.Namespace) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=args.seq, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=1024, help="loss_chunk_tokens")
    args = parser.parse_args()
    stock = build(args)
    fused = copy.deepcopy(stock)
    apply_fused_loss(fused, chunk_tokens=args.chunk)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    results: dict[str, list[tuple[float, int]]] = {"hf": [], "fused": []}
    timed_step(stock, ids, labels)  # warm-up: allocator, thread pool, first-call costs
    timed_step(fused, ids, labels)
    for _ in range(args.steps):
        results["hf"].append(timed_step(stock, ids, labels))
        results["fused"].append(timed_step(fused, ids, labels))
    tokens = args.batch * args.seq
    logits_bytes = tokens * args.vocab * 4
    print(f"Qwen2 2 layers, hidden {args.hidden}, vocab {args.vocab:,}, {args.batch} x "
          f"{args.seq} = {tokens:,} tokens, chunk {args.chunk}; fp32 logits would be "
          f"{logits_bytes / 2**20:,.0f} MiB; {torch.get_num_threads()} threads, "
          f"{args.steps} steps each")
    med = {k: statistics.median(s for s, _ in v) for k, v in results.items()}
    peak = {k: max(b for _, b in v) for k, v in results.items()}
    for name in ("hf", "fused"):
        print(f"  {name:6s} step {med[name]:.3f} s   peak RSS growth "
              f"{peak[name] / 2**20:,.0f} MiB")
    print(f"  fused / hf: step time {med['fused'] / med['hf']:.2f}x, "
          f"peak memory {peak['fused'] / peak['hf']:.2f}x")


if __name__ == "__main__":
    main()
