"""One autograd Function per decoder-layer call, and the per-forward state it works on.

Forward: the layer runs under no_grad on streamed weights and its input boundary goes to
the activation store. Backward: the input boundary is fetched (or regenerated with the
rest of its recompute block), the layer re-runs with grad under the forward's RNG and
autocast state, the input gradient is returned and the weight gradients go to the host.
State is indexed by executed position, not layer index (OPT's layerdrop skips layers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lazytrain_accel.engine.core.runtime import Runtime
from lazytrain_accel.engine.memory.activations import ActivationStore
from lazytrain_accel.engine.model.captures import capturing, recording, restore
from lazytrain_accel.engine.model.position import LayerPosition
from lazytrain_accel.engine.model.replay import capture, replaying
from lazytrain_accel.engine.sequence import layer_tiles
from lazytrain_accel.planning.plan import Home


class ForwardState:
    """Everything one forward pass leaves for its backward."""

    def __init__(self, runtime: Runtime, *,
                 begin_backward: Callable[[ForwardState], None]) -> None:
        self.rt = runtime
        self._begin_backward = begin_backward  # the engine's: wait for the update, etc.
        self.store = ActivationStore(runtime.plan, streams=runtime.streams,
                                     spill=runtime.spill, accounting=runtime.acct)
        self.positions: list[LayerPosition] = []
        self.cache: dict[int, torch.Tensor] = {}  # boundaries regenerated for a block
        # weak: the output's grad_fn holds this state; a strong ref would be a cycle
        # through the C++ graph that Python's GC cannot see (the graph would leak)
        self.last_output: weakref.ref[torch.Tensor] | None = None
        self.backwarded = False

    def close(self) -> None:
        self.store.close()
        for t in self.cache.values():
            self.rt.acct.free("device", t.numel() * t.element_size())
        self.cache.clear()

    # ---- forward -------------------------------------------------------------------
    def call(self, layer: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        leaves, spec = pytree.tree_flatten(kwargs)
        extra_ids = [k for k, v in enumerate(leaves)
                     if isinstance(v, torch.Tensor) and v.requires_grad]
        pos = LayerPosition(layer=layer, leaves=leaves, spec=spec, extra_ids=extra_ids,
                        hidden_requires_grad=hidden.requires_grad,
                        replay=capture(self.rt.streams.device),
                        tile_tokens=self.rt.plan.tile_tokens,
                        attention_block_tokens=self.rt.plan.attention_block_tokens)
        self.positions.append(pos)
        index = len(self.positions)
        home = None
        if index > 1 and (self.last_output is None or hidden is not self.last_output()) \
                and self.rt.plan.homes[index - 1] == Home.RECOMPUTE:
            home = Home.GPU  # something ran between layers: the chain cannot regenerate it
        try:
            outs = _LayerFunction.apply(self, index, home, self.rt.anchor(layer), hidden,
                                        *[leaves[k] for k in extra_ids])
        except BaseException:
            self.close()  # no boundary file outlives a failed forward
            raise
        if pos.layer_tiled and index == self.rt.plan.num_layers and outs \
                and outs[0].requires_grad:
            outs = (layer_tiles.OwnedGrad.apply(self.rt.own_grad, outs[0]), *outs[1:])
        full = list(pos.out_leaves)
        for slot, tensor in zip(pos.tensor_ids, outs[:len(pos.tensor_ids)], strict=True):
            full[slot] = tensor
        if pos.captured is not None:
            restore(pos.captured, list(outs[len(pos.tensor_ids):]))
        self.last_output = weakref.ref(outs[0]) if outs else None
        return pytree.tree_unflatten(full, pos.out_spec)

    def run_forward(self, index: int, home: Home | None, hidden: torch.Tensor) -> list[Any]:
        pos = self.positions[index - 1]
        self.store.put(index - 1, hidden, home=home)
        self.store.run_window(index - 1)
        kwargs = pytree.tree_unflatten(pos.leaves, pos.spec)
        if index == self.rt.plan.num_layers:
            self.rt.pool.forget_all_but(pos.layer)
        with capturing(hidden) as captured:
            outputs = self.rt.run_layer(pos.layer, hidden, kwargs,
                                        prefetch=self._forward_prefetch(index),
                                        counter="layer_forwards", pos=pos)
        pos.captured = captured.record
        out_leaves, pos.out_spec = pytree.tree_flatten(outputs)
        pos.tensor_ids = [k for k, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
        pos.out_leaves = [None if k in pos.tensor_ids else v for k, v in enumerate(out_leaves)]
        if not pos.tensor_ids or pos.tensor_ids[0] != 0:
            raise TypeError(f"decoder layer {pos.layer} returned {type(outputs).__name__} whose "
                            "first element is not a tensor; the engine needs the hidden state "
                            "first")
        # detached: a run with grad on (`Runtime.run_layer`) records them with a graph
        return [out_leaves[k] for k in pos.tensor_ids] + [t.detach() for t in captured.tensors]

    # ---- backward ------------------------------------------------------------------
    def input_for_backward(self, boundary: int) -> torch.Tensor:
        if boundary in self.cache:
            t = self.cache.pop(boundary)
            self.rt.acct.free("device", t.numel() * t.element_size())
            return t
        if self.store.has(boundary):
            return self.store.fetch(boundary)
        start = max(i for i in range(boundary) if self.store.has(i))
        x = self.store.fetch(start)
        for k in range(start + 1, boundary + 1):
            pos = self.positions[k - 1]
            nxt = self.positions[k].layer if k < len(self.positions) else pos.layer
            with replaying(pos.replay), recording(None):  # regenerating records nothing
                x = self.rt.run_layer(pos.layer, x, pytree.tree_unflatten(pos.leaves, pos.spec),
                                      prefetch=(nxt,), counter="layer_recomputes", pos=pos)
            x = pytree.tree_leaves(x)[0]
            self.cache[k] = x
            self.rt.acct.allocate("device", x.numel() * x.element_size())
        return self.input_for_backward(boundary)

    def layers_for_backward(self, index: int) -> tuple[int, ...]:
        """Layers the backward of position `index` computes first, to prefetch in order:
        its own, or the first re-run layer of its recompute block and then its own (which
        stays loaded through the re-runs)."""
        boundary, own = index - 1, self.positions[index - 1].layer
        if boundary in self.cache or self.store.has(boundary):
            return (own,)
        start = max(i for i in range(boundary) if self.store.has(i))
        return (self.positions[start].layer, own)

    def _forward_prefetch(self, index: int) -> tuple[int, ...]:
        """The next layer; after the last one, what the first backward needs (its layer
        is loaded already)."""
        if index < self.rt.plan.num_layers:
            return (self.positions[index - 1].layer + 1,)
        return self.layers_for_backward(index)

    def run_backward(self, index: int, grad_outs: tuple[torch.Tensor | None, ...]
                     ) -> tuple[torch.Tensor | None, ...]:
        pos = self.positions[index - 1]
        self._begin_backward(self)
        self.store.run_window(2 * self.rt.plan.num_layers - index)
        hidden = self.input_for_backward(index - 1)
        nxt = self.layers_for_backward(index - 1) if index > 1 else ()
        grads = self.rt.rerun_with_grad(pos.layer, hidden, pos, grad_outs, prefetch=nxt)
        self.store.release(index - 1)
        return grads


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: ForwardState, index: int, home: Home | None,
                anchor: torch.Tensor, hidden: torch.Tensor, *extras: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.state, ctx.index = state, index
        # an output the loss does not use gets None, not zeros: parameters reached only
        # through it keep `.grad is None`, as in plain PyTorch (an optimizer skips those)
        ctx.set_materialize_grads(False)
        outs = state.run_forward(index, home, hidden)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        try:
            grads = ctx.state.run_backward(ctx.index, grad_outs)
        except BaseException:
            ctx.state.close()  # no boundary file outlives a failed backward
            raise
        return (None, None, None, None, *grads)
