"""Benchmark of the hybrid 8-bit operator (issue 9). Prints ratios; never run by pytest.

    python bench/optimizer.py [--params-m 100] [--rounds 5] [--threads 2]

One process, the contenders alternate round by round, medians reported:
1. the machine's memory bandwidth (STREAM-like copy, alternating with the others);
2. step seconds and state bytes/param for 100M parameters in transformer-layer shapes:
   HybridAdamW8bit (native, with and without clipping; torch path once), torch AdamW
   (fused, foreach) and bitsandbytes AdamW8bit, plus the operator's achieved GB/s. Wall
   seconds and process CPU seconds are both printed: on a shared machine the CPU seconds
   are the steadier figure (they do count OpenMP spin-waits);
3. the code choice: bitsandbytes' dynamic map (table search) against the per-block-scaled
   8-bit float of codes.py: update-direction error on real Adam moments, quantize speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lazytrain_accel.optim import EXP_AVG_CODE, EXP_AVG_SQ_CODE, HybridAdamW8bit
from lazytrain_accel.optim.codes import dequantize_blockwise, quantize_blockwise

GB = 1e9


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """q, k, v, o and gate, up, down projections of one decoder layer."""
    return [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]


def make_params(total_m: int) -> list[torch.nn.Parameter]:
    shapes = layer_shapes(1024, 2816)
    per_layer = sum(a * b for a, b in shapes)
    layers = max(1, round(total_m * 1e6 / per_layer))
    params = []
    for _ in range(layers):
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape) * 0.02)
            p.grad = torch.randn(shape) * 1e-3
            params.append(p)
    return params


def time_once(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class StreamCopy:
    """STREAM copy as a contender of the alternating loop, so it sees the same machine
    load: `step()` copies `numel` floats; bytes = read + written (STREAM's count)."""

    def __init__(self, numel: int) -> None:
        self.src, self.dst = torch.randn(numel), torch.zeros(numel)  # zeros: pages touched
        self.state: dict = {}

    def step(self) -> None:
        self.dst.copy_(self.src)


def bench_steps(params: list[torch.nn.Parameter], rounds: int) -> dict[str, dict[str, float]]:
    import bitsandbytes as bnb

    numel = sum(p.numel() for p in params)
    contenders = {
        "hybrid8bit": HybridAdamW8bit(params, lr=1e-5),
        "hybrid8bit+clip": HybridAdamW8bit(params, lr=1e-5, max_grad_norm=1e9),
        "adamw_fused": torch.optim.AdamW(params, lr=1e-5, fused=True),
        "adamw_foreach": torch.optim.AdamW(params, lr=1e-5, foreach=True),
        "bnb_adamw8bit": bnb.optim.AdamW8bit(params, lr=1e-5),
        "stream_copy": StreamCopy(numel),
    }
    # bytes each step must move: grad read, master read+write, state read+write
    traffic = {"hybrid8bit": 16, "hybrid8bit+clip": 20, "adamw_fused": 28, "adamw_foreach": 28,
               "bnb_adamw8bit": 16, "stream_copy": 8}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu_times: dict[str, list[float]] = {name: [] for name in contenders}
    for opt in contenders.values():
        opt.step()  # allocate state outside the timing
    for _ in range(rounds):
        for name, opt in contenders.items():
            cpu_start = time.process_time()
            times[name].append(time_once(opt.step))
            cpu_times[name].append(time.process_time() - cpu_start)
    reference = HybridAdamW8bit(params, lr=1e-5, backend="torch")
    reference.step()
    cpu_start = time.process_time()
    times["hybrid8bit(torch path)"] = [time_once(reference.step)]
    cpu_times["hybrid8bit(torch path)"] = [time.process_time() - cpu_start]
    traffic["hybrid8bit(torch path)"] = 16
    contenders["hybrid8bit(torch path)"] = reference
    results = {}
    for name, opt in contenders.items():
        step_s = statistics.median(times[name])
        results[name] = {
            "step_s": step_s,
            "cpu_s": statistics.median(cpu_times[name]),
            "state_bytes_per_param": _state_bytes(opt) / numel,
            "achieved_bytes_per_s": traffic[name] * numel / step_s,
        }
    return results


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)


def code_choice(block_size: int = 256) -> dict[str, float]:
    """Update-direction error on Adam moments of a real run, and quantize seconds."""
    import bitsandbytes.functional as bnbf

    exp_avg, exp_avg_sq = _real_adam_moments()
    exact = exp_avg / (exp_avg_sq.sqrt() + 1e-8)
    signed_map = bnbf.create_dynamic_map(signed=True)
    unsigned_map = bnbf.create_dynamic_map(signed=False)

    def via_dynamic(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
        q, state = bnbf.quantize_blockwise(x, code=qmap, blocksize=block_size)
        return bnbf.dequantize_blockwise(q, state)

    def via_float(x: torch.Tensor, code) -> torch.Tensor:
        codes, absmax = quantize_blockwise(x, code, block_size)
        return dequantize_blockwise(codes, absmax, code, block_size).view_as(x)

    out = {}
    for name, m, v in (
        ("dynamic", via_dynamic(exp_avg, signed_map), via_dynamic(exp_avg_sq, unsigned_map)),
        ("float8", via_float(exp_avg, EXP_AVG_CODE), via_float(exp_avg_sq, EXP_AVG_SQ_CODE)),
    ):
        direction = m / (v.sqrt() + 1e-8)
        out[f"{name}_update_rel_err"] = float((direction - exact).norm() / exact.norm())
    big = torch.randn(16_000_000)
    out["dynamic_quantize_s"] = min(time_once(lambda: bnbf.quantize_blockwise(
        big, code=signed_map, blocksize=block_size)) for _ in range(3))
    out["dynamic_quantize_torch_s"] = min(time_once(lambda: _bucketize_quantize(
        big, signed_map, block_size)) for _ in range(3))
    out["float8_quantize_torch_s"] = min(time_once(lambda: quantize_blockwise(
        big, EXP_AVG_CODE, block_size)) for _ in range(3))
    return out


def _bucketize_quantize(x: torch.Tensor, qmap: torch.Tensor, block_size: int) -> torch.Tensor:
    """The dynamic map's table search written in torch, same blocking as codes.py."""
    blocks = x.view(-1, block_size)
    absmax = blocks.abs().amax(1, keepdim=True)
    midpoints = (qmap[1:] + qmap[:-1]) / 2
    return torch.bucketize(blocks / absmax, midpoints).to(torch.uint8)


def _real_adam_moments() -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg / exp_avg_sq of a tiny Qwen2 after 60 fp32 AdamW steps on random tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=352,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(60):
        ids = torch.randint(0, 512, (8, 64))
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    states = [opt.state[p] for p in model.parameters() if p.numel() >= 4096]
    return (torch.cat([s["exp_avg"].flatten() for s in states]),
            torch.cat([s["exp_avg_sq"].flatten() for s in states]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=100, help="millions of parameters")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} torch={torch.__version__} "
          f"cpu={torch.backends.cpu.get_cpu_capability()}")
    params = make_params(args.params_m)
    numel = sum(p.numel() for p in params)
    print(f"{numel / 1e6:.1f}M parameters in {len(params)} tensors")
    results = bench_steps(params, args.rounds)
    bandwidth = results.pop("stream_copy")["achieved_bytes_per_s"]
    print(f"memory bandwidth (STREAM copy, same rounds): {bandwidth / GB:.1f} GB/s")
    fused, bnb_r = results["adamw_fused"], results["bnb_adamw8bit"]
    for name, r in results.items():
        print(f"{name:24s} step {r['step_s']:.4f} s (x{r['step_s'] / fused['step_s']:5.2f} of "
              f"fused, bnb/this {bnb_r['step_s'] / r['step_s']:5.1f}x)  cpu {r['cpu_s']:.3f} s "
              f"(x{r['cpu_s'] / fused['cpu_s']:5.2f}, bnb/this {bnb_r['cpu_s'] / r['cpu_s']:5.1f}x)"
              f"  state {r['state_bytes_per_param']:.2f} B/param  "
              f"{r['achieved_bytes_per_s'] / GB:5.1f} GB/s "
              f"({r['achieved_bytes_per_s'] / bandwidth:.0%} of copy)")
    for key, value in code_choice().items():
        print(f"code choice: {key} = {value:.4g}")


if __name__ == "__main__":
    main()
