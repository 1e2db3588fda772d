"""Sequence tiles for a streamed layer's token-wise block (its MLP, MoE experts included).

As ALST's TiledMLP does, the MLP runs over tiles of `Plan.tile_tokens` flattened tokens:
while a streamed layer runs, its MLP's `forward` is replaced on the instance (`tiled`) by
`_TiledCall`, whose forward runs the tiles under no_grad into a preallocated output and
whose backward re-runs each tile with grad (RNG and autocast replayed), writes its input
gradient slice and sums the weight gradients: one tile's intermediates at a time. Router
logits the MLP hands to transformers' output collector are taken per tile and returned
in token order (`captures.py`), so the aux loss's gradient reaches the tiles' backward.
Design: docs/engine.md "Long context" (**Tiled token-wise block**).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lazytrain_accel.engine.model import captures
from lazytrain_accel.engine.model.replay import ReplayState, capture, replaying

#: Share of a layer's parameters outside attention that its token-wise block holds at least.
MLP_PARAM_SHARE = 0.5


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_attention(name: str, module: nn.Module) -> bool:
    return "attention" in type(module).__name__.lower() or "attn" in name.lower()


def find_token_mlp(layer: nn.Module) -> nn.Module | None:
    """The layer's token-wise block: the direct child that is not attention, has children
    of its own and holds more than half of the parameters outside attention (`mlp` in every
    family the engine is tested on). None where no child qualifies (OPT keeps `fc1`/`fc2`
    on the layer itself): that layer runs untiled."""
    rest = [m for name, m in layer.named_children() if not _is_attention(name, m)]
    blocks = [m for m in rest if any(True for _ in m.children())
              and not isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    if not blocks:
        return None
    best = max(blocks, key=_numel)
    return best if _numel(best) > MLP_PARAM_SHARE * sum(_numel(m) for m in rest) else None


def _tile(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of `t` ([..., tokens, hidden] flattened) as [1, end - start, hidden]."""
    return t.reshape(-1, t.shape[-1])[start:end].unsqueeze(0)


@dataclass(kw_only=True)
class _Call:
    """One tiled MLP call: its own forward, arguments and tiles, and what it captured."""

    forward: Callable[..., Any]
    leaves: list[Any]  # flattened (args, kwargs)
    spec: pytree.TreeSpec
    token_ids: list[int]  # leaves cut into tiles: tensors shaped as the hidden state
    shape: torch.Size  # [..., tokens, hidden]
    bounds: list[tuple[int, int]]  # each tile's [start, end) in the flattened tokens
    keys: list[str] = field(default_factory=list)  # collector key of each captured output
    token_dims: list[int] = field(default_factory=list)  # the dim tiles concatenate along
    replay: ReplayState | None = None

    def run_tile(self, tiles: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, Any]]]:
        leaves = list(self.leaves)
        for k, t in zip(self.token_ids, tiles, strict=True):
            leaves[k] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        prior = captures.collector_lengths()
        out = self.forward(*args, **kwargs)
        taken = captures.take_appended(prior)
        if not isinstance(out, torch.Tensor) or out.shape != tiles[0].shape:
            raise TypeError(f"the token-wise block returned {type(out).__name__} "
                            f"{getattr(out, 'shape', '')} for a tile of shape "
                            f"{tuple(tiles[0].shape)}; it cannot run in sequence tiles: plan "
                            "with tiling 'none'")
        return out, taken

    def join(self, per_tile: list[list[tuple[str, Any]]]) -> list[torch.Tensor]:
        """Concatenate what each tile captured, slot by slot, into the untiled layout."""
        self.keys = [key for key, _ in per_tile[0]]
        joined = []
        for slot in range(len(self.keys)):
            parts = [taken[slot][1] for taken in per_tile]
            dim = _token_dim(parts[0], self.bounds[0][1] - self.bounds[0][0], self.keys[slot])
            self.token_dims.append(dim)
            whole = torch.cat(parts, dim=dim)
            joined.append(whole.reshape(*self.shape[:-1], *whole.shape[2:]) if dim else whole)
        return joined

    def cap_grad(self, slot: int, grad: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.token_dims[slot] == 0:
            return grad[start:end]
        flat = grad.reshape(1, -1, *grad.shape[len(self.shape) - 1:])
        return flat[:, start:end]


def _token_dim(value: Any, tokens: int, key: str) -> int:
    if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[:2] == (1, tokens):
        return 1
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == tokens:
        return 0
    raise TypeError(f"the token-wise block recorded {key!r} with shape "
                    f"{tuple(getattr(value, 'shape', ()))} for a tile of {tokens} tokens: not "
                    "per token, it cannot be tiled; plan with tiling 'none'")


class _TiledCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, num_tokens_inputs: int, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        token = tensors[:num_tokens_inputs]
        call.replay = capture(token[0].device)
        out: torch.Tensor | None = None
        per_tile = []
        for start, end in call.bounds:
            y, taken = call.run_tile([_tile(t, start, end) for t in token])
            if out is None:
                out = y.new_empty(call.shape)  # the output's dtype is the first tile's
            out.view(-1, call.shape[-1])[start:end] = y[0]
            per_tile.append(taken)
        ctx.call, ctx.num_token = call, num_tokens_inputs
        ctx.weights = tensors[num_tokens_inputs:]  # parameters: leaves, no graph to hold
        ctx.save_for_backward(*token)
        ctx.set_materialize_grads(False)
        return (out, *call.join(per_tile))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, *grad_caps: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        token = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:2 + ctx.num_token]
        weights = list(ctx.weights)
        token_grads = [torch.zeros_like(t) if need else None
                       for t, need in zip(token, needs, strict=True)]
        param_grads: list[torch.Tensor | None] = [None] * len(weights)
        with replaying(call.replay), torch.enable_grad(), captures.collecting(call.keys):
            for start, end in call.bounds:
                tiles = [_tile(t, start, end).detach().requires_grad_(bool(need))
                         for t, need in zip(token, needs, strict=True)]
                y, taken = call.run_tile(tiles)
                pairs = [(y, _tile(grad_out, start, end))] if grad_out is not None else []
                pairs += [(v, call.cap_grad(slot, g, start, end))
                          for slot, ((_, v), g) in enumerate(zip(taken, grad_caps, strict=True))
                          if g is not None]
                pairs = [(o, g) for o, g in pairs if o.requires_grad]
                inputs = [t for t in tiles if t.requires_grad] + weights
                if not pairs or not inputs:
                    continue
                got = list(torch.autograd.grad([o for o, _ in pairs], inputs,
                                               [g for _, g in pairs], allow_unused=True))
                for grad in token_grads:
                    if grad is not None:
                        g = got.pop(0)
                        if g is not None:
                            grad.view(-1, call.shape[-1])[start:end] = g[0]
                for k, g in enumerate(got):
                    if g is not None:
                        param_grads[k] = g if param_grads[k] is None else param_grads[k].add_(g)
        return (None, None, *token_grads, *param_grads)


def _run_tiled(own: Callable[..., Any], mlp: nn.Module, tile_tokens: int,
               *args: Any, **kwargs: Any) -> Any:
    """The MLP's forward over tiles of `tile_tokens` tokens (its own when one tile holds
    them all)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() // x.shape[-1] <= tile_tokens:
        return own(*args, **kwargs)
    tokens = x.numel() // x.shape[-1]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    token_ids = [k for k, v in enumerate(leaves)
                 if isinstance(v, torch.Tensor) and v.shape == x.shape]
    call = _Call(forward=own, leaves=leaves, spec=spec, token_ids=token_ids, shape=x.shape,
                 bounds=[(a, min(a + tile_tokens, tokens)) for a in range(0, tokens, tile_tokens)])
    weights = [p for p in mlp.parameters() if p.requires_grad]
    out, *caps = _TiledCall.apply(call, len(token_ids), *[leaves[k] for k in token_ids],
                                  *weights)
    for key, cap in zip(call.keys, caps, strict=True):
        captures.append(key, cap)  # the Function's outputs: the aux loss differentiates them
    return out


@contextmanager
def tiled(mlp: nn.Module | None, tile_tokens: int) -> Iterator[None]:
    """Run the body with `mlp`'s forward tiled by `tile_tokens` tokens (an instance patch,
    undone after; nothing when `mlp` is None or `tile_tokens` is 0)."""
    if mlp is None or tile_tokens <= 0:
        yield
        return
    saved = mlp.__dict__.get("forward")  # an instance forward already there (a wrapper)
    mlp.forward = functools.partial(_run_tiled, mlp.forward, mlp, tile_tokens)
    try:
        yield
    finally:
        if saved is None:
            del mlp.__dict__["forward"]
        else:
            mlp.forward = saved
