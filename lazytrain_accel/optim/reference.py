"""The AdamW update with 8-bit blockwise moments, in plain torch: the test oracle.

The native kernel must reproduce these functions bit for bit, so every line here is one
correctly rounded fp32 operation (mul, add, div, sqrt) in the same order as the kernel's
loop; no fused multiply-add (torch's `add(..., alpha=)` is one, so it is avoided).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lazytrain_accel.optim.codes import (
    EXP_AVG_CODE,
    EXP_AVG_SQ_CODE,
    dequantize_blockwise,
    quantize_blockwise,
)


@dataclass(kw_only=True, frozen=True)
class AdamStepScalars:
    """The per-tensor scalars of one AdamW step, derived once in double precision.

    `clip_coef` multiplies the gradient inside the update (1.0 = no clipping).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    clip_coef: float = 1.0

    @property
    def decay(self) -> float:
        """Decoupled weight decay factor applied to the master before the Adam step."""
        return 1.0 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def inv_bias_correction2_sqrt(self) -> float:
        return 1.0 / math.sqrt(1.0 - self.beta2**self.step)


def _moments_and_master_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: AdamStepScalars,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New fp32 (exp_avg, exp_avg_sq) from the old ones; updates the flat master in place."""
    g = grad.reshape(-1).float()
    if s.clip_coef != 1.0:
        g = g * s.clip_coef
    exp_avg = exp_avg.mul(s.beta1).add_(g.mul(1.0 - s.beta1))
    exp_avg_sq = exp_avg_sq.mul(s.beta2).add_(g.mul(g).mul_(1.0 - s.beta2))
    # torch's fp32 sqrt on CPU is not correctly rounded (it differs from IEEE in ~1 of 5
    # values); sqrt in fp64 rounded once to fp32 is, and so is the kernel's vsqrtps
    root = exp_avg_sq.double().sqrt_().float()
    denom = root.mul_(s.inv_bias_correction2_sqrt).add_(s.eps)
    update = exp_avg.div(denom).mul_(s.step_size)
    flat = param.data.view(-1)  # callers pass a contiguous master
    flat.mul_(s.decay)
    flat.sub_(update)
    return exp_avg, exp_avg_sq


def adamw8bit_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    scalars: AdamStepScalars,
    *,
    block_size: int,
    out_bf16: torch.Tensor | None = None,
) -> None:
    """One AdamW step of an fp32 master with 8-bit blockwise moments, in place.

    `state` holds `exp_avg_codes`/`exp_avg_sq_codes` (uint8, one per element) and
    `exp_avg_absmax`/`exp_avg_sq_absmax` (fp32, one per block); `grad` is fp32 or bf16;
    `out_bf16`, when given, receives the bf16 copy of the updated master.
    """
    exp_avg = dequantize_blockwise(
        state["exp_avg_codes"], state["exp_avg_absmax"], EXP_AVG_CODE, block_size
    )
    exp_avg_sq = dequantize_blockwise(
        state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], EXP_AVG_SQ_CODE, block_size
    )
    exp_avg, exp_avg_sq = _moments_and_master_(param, grad, exp_avg, exp_avg_sq, scalars)
    for name, values, code in (
        ("exp_avg", exp_avg, EXP_AVG_CODE),
        ("exp_avg_sq", exp_avg_sq, EXP_AVG_SQ_CODE),
    ):
        codes, absmax = quantize_blockwise(values, code, block_size)
        state[f"{name}_codes"].copy_(codes)
        state[f"{name}_absmax"].copy_(absmax)
    if out_bf16 is not None:
        out_bf16.copy_(param.data.view_as(out_bf16))


def adamw_fp32_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    scalars: AdamStepScalars,
    *,
    out_bf16: torch.Tensor | None = None,
) -> None:
    """The same step with fp32 moments (`exp_avg`, `exp_avg_sq`), for small tensors."""
    exp_avg, exp_avg_sq = _moments_and_master_(
        param, grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), scalars
    )
    state["exp_avg"].view(-1).copy_(exp_avg)
    state["exp_avg_sq"].view(-1).copy_(exp_avg_sq)
    if out_bf16 is not None:
        out_bf16.copy_(param.data.view_as(out_bf16))
