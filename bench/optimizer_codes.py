"""The 8-bit code choice of issue 9: bitsandbytes' dynamic map (table search) against the
per-block-scaled 8-bit float of codes.py: update-direction error on real Adam moments, and
quantize speed. Run by `python bench/optimizer.py --code-choice`; never by pytest.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lazytrain_accel.optim import EXP_AVG_CODE, EXP_AVG_SQ_CODE
from lazytrain_accel.optim.codes import dequantize_blockwise, quantize_blockwise


def time_once(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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


def print_code_choice() -> None:
    for key, value in code_choice().items():
        print(f"code choice: {key} = {value:.4g}")
