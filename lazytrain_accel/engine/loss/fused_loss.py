"""Fused, chunked linear + cross-entropy: the loss of a causal LM without its full logits.

HF's loss materializes tokens x vocab logits in the compute dtype, their fp32 upcast and
their fp32 gradient (about 1.5 GB per 1024-token sample at Qwen's 151,936-entry
vocabulary). Here the head matmul, the cross-entropy and its gradient run chunk by chunk
of tokens inside one autograd Function, so only one chunk of logits exists at a time.
The gradients of the hidden states, of the head weight and bias are computed during the
forward (the chunk's softmax is at hand then); the backward only scales them by the
incoming gradient (Liger-Kernel's FusedLinearCrossEntropy does the same).

Rows whose target is `ignore_index` are skipped entirely (no logits, zero gradient), so
prompt-masked fine-tuning also saves the head's FLOPs on the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Elementwise transforms a model may apply to its logits before the loss, in order.
LOGIT_OP_KINDS = ("mul", "div", "tanh", "upcast")


@dataclass(frozen=True, kw_only=True)
class LogitOp:
    """One elementwise step between the head matmul and the loss.

    `mul`/`div` by `value` (logit scaling, Cohere/Granite), `tanh` (Gemma's softcapping is
    div c, tanh, mul c), `upcast` (to fp32: HF's loss does `logits.float()`). The ops run
    in the dtype the logits have at that point, as the model's own code would run them.
    """

    kind: str
    value: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in LOGIT_OP_KINDS:
            raise ValueError(f"LogitOp kind={self.kind!r} is not one of {LOGIT_OP_KINDS}")
        if self.kind == "div" and self.value == 0:
            raise ValueError("LogitOp('div') by 0: the logits would be infinite")


@dataclass(frozen=True, kw_only=True)
class _Spec:
    chunk_tokens: int
    ignore_index: int
    reduction: str
    compute_dtype: torch.dtype
    logit_ops: tuple[LogitOp, ...]
    grad_enabled: bool


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int,
    ignore_index: int = -100,
    reduction: str = "mean",
    compute_dtype: torch.dtype | None = None,
    logit_ops: tuple[LogitOp, ...] = (),
) -> torch.Tensor:
    """`F.cross_entropy(ops(hidden @ weight.T + bias).float(), targets)` in token chunks.

    hidden: (..., H); weight: (V, H); targets: (...) with the same leading shape (already
    aligned: no shift here) or flat (N,). `reduction` is "mean" (over non-ignored targets;
    NaN when there are none, as torch) or "sum". `compute_dtype` is the dtype of the
    matmul: by default the autocast dtype when autocast is on for hidden's device, else
    the promoted dtype of hidden and weight. The loss is always computed in fp32.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive integer")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: the fused loss supports 'mean' and 'sum' "
                         "(per-token losses need the full logits; use the model's own loss)")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do "
                         "not match: expected hidden (..., H) and weight (vocab, H)")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_targets.numel() != flat_hidden.shape[0]:
        raise ValueError(f"{flat_targets.numel()} targets for {flat_hidden.shape[0]} hidden "
                         f"rows (hidden {tuple(hidden.shape)}, targets {tuple(targets.shape)})")
    if compute_dtype is None:
        device_type = hidden.device.type
        compute_dtype = (torch.get_autocast_dtype(device_type)
                         if torch.is_autocast_enabled(device_type)
                         else torch.promote_types(hidden.dtype, weight.dtype))
    spec = _Spec(chunk_tokens=chunk_tokens, ignore_index=ignore_index, reduction=reduction,
                 compute_dtype=compute_dtype, logit_ops=tuple(logit_ops),
                 grad_enabled=torch.is_grad_enabled())
    return _FusedLinearCrossEntropy.apply(flat_hidden, weight, bias,
                                          flat_targets.to(flat_hidden.device), spec)


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    logit_ops: tuple[LogitOp, ...] = (),
) -> torch.Tensor:
    """HF's `ForCausalLMLoss` on hidden states (B, T, H): labels shifted left by one (the
    last position predicts nothing), mean over non-ignored tokens, or sum divided by
    `num_items_in_batch` when given (gradient accumulation across micro-batches)."""
    if shift_labels is None:
        padded = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = fused_linear_cross_entropy(
        hidden, weight, shift_labels, bias=bias, chunk_tokens=chunk_tokens,
        ignore_index=ignore_index, reduction=reduction, compute_dtype=compute_dtype,
        logit_ops=logit_ops)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, spec: _Spec) -> torch.Tensor:
        need = [spec.grad_enabled and n for n in ctx.needs_input_grad[:3]]
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grads = _loss_and_grads(hidden, weight, bias, targets, spec, need)
        ctx.save_for_backward(*grads)
        ctx.present = [g is not None for g in grads]
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if present else None for present in ctx.present]
        # Grads were computed for d(loss) = 1; skip the multiply in that (usual) case.
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
            grads = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
        return grads[0], grads[1], grads[2], None, None


def _loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, spec: _Spec, need: list[bool]
                    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Loss and (hidden, weight, bias) gradients for d(loss) = 1, one token chunk at a time."""
    rows = (targets != spec.ignore_index).nonzero().squeeze(1)
    n_valid = rows.numel()
    _check_targets(targets.index_select(0, rows), weight.shape[0], spec.ignore_index)
    all_rows = n_valid == targets.numel()  # then chunks are plain slices, no gather
    w_c = weight.to(spec.compute_dtype)
    b_c = None if bias is None else bias.to(spec.compute_dtype)
    grad_h = torch.zeros_like(hidden) if need[0] else None
    grad_w = torch.zeros_like(weight) if need[1] else None
    grad_b = torch.zeros_like(bias, dtype=torch.float32) if need[2] else None
    scale = 1.0 / n_valid if spec.reduction == "mean" and n_valid else 1.0
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n_valid, spec.chunk_tokens):
        stop = min(start + spec.chunk_tokens, n_valid)
        idx = rows[start:stop]
        h_c = hidden[start:stop] if all_rows else hidden.index_select(0, idx)
        t_c = targets[start:stop] if all_rows else targets.index_select(0, idx)
        chunk_loss, part = _chunk(h_c.to(spec.compute_dtype), t_c, w_c, b_c, spec, scale,
                                  need_h=grad_h is not None, grad_w=grad_w, grad_b=grad_b)
        loss_sum += chunk_loss
        if part is not None:
            if all_rows:
                grad_h[start:stop] = part
            else:
                grad_h.index_copy_(0, idx, part.to(hidden.dtype))
    # Mean: 0 / 0 = NaN when every target is ignored, as torch's own loss.
    loss = loss_sum / n_valid if spec.reduction == "mean" else loss_sum
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return loss, [grad_h, grad_w, grad_b]


def _check_targets(picked: torch.Tensor, vocab: int, ignore_index: int) -> None:
    if picked.numel() == 0:
        return
    low, high = int(picked.min()), int(picked.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"target {low if low < 0 else high} is outside the vocabulary "
                         f"[0, {vocab}) and is not ignore_index={ignore_index}; check the labels")


def _chunk(h_c: torch.Tensor, t_c: torch.Tensor, w_c: torch.Tensor, b_c: torch.Tensor | None,
           spec: _Spec, scale: float, *, need_h: bool, grad_w: torch.Tensor | None,
           grad_b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: its summed loss and hidden gradient; adds into grad_w / grad_b. Its own
    function so the chunk's (tokens, V) buffer is freed before the next one exists."""
    x, derivs = _apply_ops(F.linear(h_c, w_c, b_c), spec.logit_ops)  # (chunk, V) fp32
    loss = _exp_and_loss_(x, t_c)
    if not (need_h or grad_w is not None or grad_b is not None):
        return loss, None
    g = _grad_logits_(x, t_c, scale, spec.logit_ops, derivs).to(spec.compute_dtype)
    del x, derivs
    if grad_w is not None:
        _accumulate_mm_(grad_w, g.t(), h_c)
    if grad_b is not None:
        grad_b += g.sum(0, dtype=torch.float32)
    return loss, (g @ w_c if need_h else None)


def _apply_ops(logits: torch.Tensor, ops: tuple[LogitOp, ...]
               ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(fp32 transformed logits, per-op derivative factors for tanh). Out of place, so the
    caller may overwrite the result in place."""
    x, derivs = logits, []
    for op in ops:
        derivs.append(None)
        if op.kind == "mul":
            x = x * op.value
        elif op.kind == "div":
            x = x / op.value
        elif op.kind == "tanh":
            x = torch.tanh(x)
            derivs[-1] = 1.0 - x.float().square()
        else:
            x = x.float()
    return x.float(), derivs


def _exp_and_loss_(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the rows of `x` (fp32 logits), leaving softmax in `x`.

    In place, row max first (as logsumexp does, for range), so no second (chunk, V)
    buffer ever exists: `torch.logsumexp` would allocate one for exp(x - max).
    """
    picked = x.gather(1, targets[:, None]).squeeze(1)
    row_max = x.amax(dim=1, keepdim=True)
    x.sub_(row_max).exp_()
    sums = x.sum(dim=1, keepdim=True)
    x.div_(sums)
    lse = sums.log_().add_(row_max).squeeze(1)
    return (lse - picked).sum()


def _grad_logits_(x: torch.Tensor, targets: torch.Tensor, scale: float,
                  ops: tuple[LogitOp, ...], derivs: list[torch.Tensor | None]) -> torch.Tensor:
    """d(loss)/d(logits before the ops), written over `x` (holding the softmax): softmax -
    one-hot, then back through the ops in reverse."""
    x[torch.arange(x.shape[0], device=x.device), targets] -= 1.0
    if scale != 1.0:
        x.mul_(scale)
    for op, deriv in zip(reversed(ops), reversed(derivs), strict=True):
        if op.kind == "mul":
            x.mul_(op.value)
        elif op.kind == "div":
            x.div_(op.value)
        elif op.kind == "tanh":
            x.mul_(deriv)
    return x


def _accumulate_mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b. In place when the dtypes agree (no (V, H) temporary); otherwise (fp32
    weight, bf16 compute under autocast) through one compute-dtype product."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)
