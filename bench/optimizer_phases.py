"""Where the clipping step's time goes (issue 32): each phase of HybridAdamW8bit's step with
clipping timed on its own, beside the phases of fused AdamW + `clip_grad_norm_`. Prints
medians and ratios; never run by pytest.

    python bench/optimizer_phases.py [--params-m 200] [--threads 2] [--rounds 5]

One process, the phases alternating round by round (as bench/optimizer.py does):
- `norm:tensor_norms`: the per-tensor norms as `clipping.tensor_norms` takes them (the
  tensors shared among torch's threads), the pass our clipping adds;
- `norm:one foreach`: the same norms from one `torch._foreach_norm(grads, dtype=float32)`
  call, on one thread (how `tensor_norms` took them before);
- `norm:combine+coef`: their global norm and the clip coefficient (`.item()` included);
- `ours:update`, `ours:update(coef<1)`: the kernel's pass, with coefficient 1 and below 1
  (the multiply is inside the kernel: no pass of its own);
- `ours+clip:step`: the whole step, the sum of the above;
- `clip_grad_norm_:norm`, `clip_grad_norm_:mul`: torch's clip split into its norm pass and
  its in-place multiply of the gradients (`_foreach_mul_`);
- `adamw_fused:step`: fused AdamW's step alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from optimizer import cpu_description, kernel_variant, make_params

from lazytrain_accel.optim import HybridAdamW8bit, clipping


def phases(params: list[torch.nn.Parameter], variant: str) -> dict[str, Callable[[], None]]:
    grads = [p.grad for p in params]
    with kernel_variant(variant):
        ours = HybridAdamW8bit(params, lr=1e-5, max_grad_norm=1e9)
    fused = torch.optim.AdamW(params, lr=1e-5, fused=True)
    norms: list[torch.Tensor] = clipping.tensor_norms(grads)

    def norm_tensor_norms() -> None:
        norms[:] = clipping.tensor_norms(grads)

    def norm_one_foreach() -> None:
        torch._foreach_norm(grads, 2.0, dtype=torch.float32)

    def combine_coef() -> None:
        clipping.clip_coefficient(clipping.combine_norms(norms), 1e9)

    def update(coef: float) -> Callable[[], None]:
        def run() -> None:
            ours.max_grad_norm = None  # no norm pass: begin_step decides coefficient 1
            ours.begin_step()
            ours.max_grad_norm = 1e9
            ours._context = dataclasses.replace(ours._context, clip_coef=coef)
            ours.step_params(params)
            ours.end_step()
        return run

    def ours_clip_step() -> None:
        if ours.begin_step():
            ours.step_params(params)
        ours.end_step()

    def torch_norm() -> None:
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0).item()

    return {"norm:tensor_norms": norm_tensor_norms, "norm:one foreach": norm_one_foreach,
            "norm:combine+coef": combine_coef,
            "ours:update": update(1.0), "ours:update(coef<1)": update(1.0 - 2**-20),
            "ours+clip:step": ours_clip_step, "clip_grad_norm_:norm": torch_norm,
            "clip_grad_norm_:mul": lambda: torch._foreach_mul_(grads, 1.0),
            "adamw_fused:step": fused.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=200, help="millions of parameters")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variant", default="avx2", help="our kernel variant (avx2, avx512)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_description()}; {args.threads} thread(s); ours[{args.variant}]")
    params = make_params(args.params_m)
    numel = sum(p.numel() for p in params)
    steps = phases(params, args.variant)
    for step in steps.values():
        step()  # state allocated, pages touched, outside the timing
    wall_s: dict[str, list[float]] = {name: [] for name in steps}
    cpu_s: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            wall_s[name].append(time.perf_counter() - wall)
            cpu_s[name].append(time.process_time() - cpu)
    fused_s = statistics.median(wall_s["adamw_fused:step"])
    print(f"{numel / 1e6:.1f}M parameters, median of {args.rounds} rounds")
    print(f"{'phase':22s} {'wall s':>7s} {'cpu s':>7s} {'vs fused step':>13s} "
          f"{'grad GB/s':>9s}")
    for name in steps:
        seconds = statistics.median(wall_s[name])
        print(f"{name:22s} {seconds:7.4f} {statistics.median(cpu_s[name]):7.3f} "
              f"{seconds / fused_s:12.2f}x {4 * numel / seconds / 1e9:9.1f}")


if __name__ == "__main__":
    main()
