"""CPU step time of the streaming engine (`checkpoint_all`) vs HF gradient checkpointing.

Same ~60M-parameter Qwen2 model (two identical copies), same process, alternating steps;
prints the median step-time ratio and the peak RSS growth of each variant during its
steps (sampled from /proc every 2 ms). Usage: python bench/engine.py [--steps 6]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import threading
import time

import torch
import transformers
from peak_rss import status_bytes

from lazytrain_accel.engine import attach
from lazytrain_accel.planning import make_plan
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import geometry_from_config, profile_model


class PeakRss:
    """Highest RSS seen while the `with` body runs."""

    def __enter__(self) -> PeakRss:
        self.start_bytes = self.peak_bytes = status_bytes("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak_bytes = max(self.peak_bytes, status_bytes("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def build(args: argparse.Namespace) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=args.seq, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    hf = build(args)
    streamed = copy.deepcopy(hf)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    nvme_dir = tempfile.mkdtemp(prefix="lazytrain-bench-")
    # The planner's checkpoint_all plan for this very batch shape (fp32 compute).
    profile = profile_model(geometry_from_config(hf.config.to_dict()), batch_size=args.batch,
                            seq_len=args.seq, compute_bytes_per_elem=4)
    plan = make_plan(profile, HARDWARE_PRESETS["h800"], PlanRequest(strategy="checkpoint_all"))
    engine = attach(streamed, plan, device=torch.device("cpu"), nvme_dir=nvme_dir)
    variants = {"hf_checkpointing": (hf, torch.optim.AdamW(hf.parameters(), lr=1e-4)),
                "engine": (streamed, torch.optim.AdamW(streamed.parameters(), lr=1e-4))}
    ids = torch.randint(0, 32000, (args.batch, args.seq))
    params = sum(p.numel() for p in hf.parameters())
    print(f"model: {params / 1e6:.1f}M params, {args.layers} layers, batch {args.batch} x "
          f"seq {args.seq}, {torch.get_num_threads()} threads")
    for model, opt in variants.values():  # warm-up: allocator, optimizer state
        step(model, opt, ids)
    times = {name: [] for name in variants}
    peaks = dict.fromkeys(variants, 0)
    for _ in range(args.steps):
        for name, (model, opt) in variants.items():  # alternate to share drift fairly
            with PeakRss() as rss:
                times[name].append(step(model, opt, ids))
            peaks[name] = max(peaks[name], rss.peak_bytes - rss.start_bytes)
    base = statistics.median(times["hf_checkpointing"])
    for name in variants:
        med = statistics.median(times[name])
        print(f"{name:18s} median step {med:.3f} s  ratio {med / base:.3f}x  "
              f"peak RSS growth {peaks[name] / 2**20:.0f} MiB")
    stats = engine.stats()
    print(f"engine stats (all steps): compute {stats.compute_s:.2f} s, stall {stats.stall_s:.3f}"
          f" s, weights copied {stats.transfer_s['weights_h2d']:.3f} s")
    engine.detach()


if __name__ == "__main__":
    main()
