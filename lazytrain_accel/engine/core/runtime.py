"""The engine parts a layer call needs: weight pool, gradient sink, store backends, plan.

Kept apart from `StreamingEngine` (attach/detach, hooks, optimizer overlap) so the layer
Function only sees what it uses.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lazytrain_accel.engine.device.streams import Streams
from lazytrain_accel.engine.memory.grads import GradSink
from lazytrain_accel.engine.memory.nvme import NvmeSpill
from lazytrain_accel.engine.memory.quantized import forward_follows_grad_mode
from lazytrain_accel.engine.memory.weights import WeightPool
from lazytrain_accel.engine.model.captures import recorded, recording
from lazytrain_accel.engine.model.position import LayerPosition
from lazytrain_accel.engine.model.replay import replaying
from lazytrain_accel.engine.sequence import layer_tiles, long_sequence, query_blocks, tiles
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.planning.plan import Plan

logger = logging.getLogger("lazytrain_accel")


class Runtime:
    def __init__(self, *, plan: Plan, layers: list[nn.Module],
                 originals: list[Callable[..., Any]],
                 trainable: list[list[nn.Parameter]], streams: Streams, acct: Accounting,
                 spill: NvmeSpill, pool: WeightPool, sink: GradSink,
                 whole_layer_reason: str = "") -> None:
        """`whole_layer_reason`: why the model's layers cannot run in sequence tiles, from
        its config (`profiling.whole_layers.whole_layer_reason`, which the planner's
        working set reads too; "" = they can): they then run whole from the first call."""
        self.plan = plan
        self.streams = streams
        self.acct = acct
        self.spill = spill
        self.pool = pool
        self.sink = sink
        self._layers = layers  # index 0 = layer 1
        self._originals = originals  # the layers' own forwards, index 0 = layer 1
        self._trainable = trainable
        self._mlps = [tiles.find_token_mlp(layer) for layer in layers]  # None: untiled
        self._attention_configs = query_blocks.check_layers(layers, plan.attention_block_tokens)
        self._untiled_said = False
        # False where the config says the layers run whole, or once a layer proved it cannot
        self._whole_reason = whole_layer_reason
        self._whole_said = False
        self._unplanned_said: set[int] = set()  # layers warned about running whole
        self._layer_tiles_ok = [not whole_layer_reason] * len(layers)
        # the input gradient a sequence-tiled backward last handed out: autograd passes it
        # on to the layer below as its output gradient, which overwrites it in place
        self._owned: weakref.ref[torch.Tensor] | None = None
        # A grad-requiring scalar per trainable layer keeps its Function in the graph
        # even when the hidden state needs no grad (frozen embeddings, LoRA-style).
        self._anchors = [torch.zeros((), device=streams.device, requires_grad=bool(ps))
                         for ps in trainable]

    def set_plan(self, plan: Plan) -> None:
        """Run later layer calls with `plan` (refused when its query blocks cannot run)."""
        query_blocks.check_layers(self._layers, plan.attention_block_tokens)
        self.plan = plan

    @contextmanager
    def _shaped(self, layer: int, hidden: torch.Tensor, *, tile_tokens: int,
                block_tokens: int) -> Iterator[None]:
        """How layer `layer` runs on `hidden`: fused attention kernels at long sequence,
        its attention in query blocks of `block_tokens`, its MLP in tiles of `tile_tokens`
        (0: whole). A sequence-tiled layer (`layer_tiles`) passes `block_tokens=0`: its
        tiles are its query blocks."""
        with long_sequence.fused_attention(hidden), \
                query_blocks.query_blocks(self._attention_configs[layer - 1], block_tokens), \
                tiles.tiled(self._token_mlp(layer, tile_tokens), tile_tokens):
            yield

    def tiles_layer(self, layer: int, hidden: torch.Tensor) -> bool:
        """Whether a call of `layer` on `hidden` under the current plan may run the whole
        layer in sequence tiles (not where the config or an earlier call said it runs whole)."""
        return (layer_tiles.applies(hidden, self.plan.attention_block_tokens)
                and self._layer_tiles_ok[layer - 1])

    def _layer_tiled(self, layer: int, hidden: torch.Tensor, block_tokens: int,
                     pos: LayerPosition | None, counter: str) -> bool:
        """Whether this call of `layer` runs the whole layer in sequence tiles: a re-run
        as its forward ran; a forward when its plan has query blocks shorter than the
        sequence, the layer has not proved it cannot (`layer_tiles.Unsupported`) and no
        kwarg needs a gradient."""
        if pos is not None and counter != "layer_forwards":
            return pos.layer_tiled
        if not layer_tiles.applies(hidden, block_tokens):
            return False
        if self._whole_reason and not self._whole_said:
            self._whole_said = True
            logger.info("lazytrain: the decoder layers (%s) cannot run in sequence tiles (%s); "
                        "they run whole, their attention in query blocks, as the plan sized "
                        "them", type(self._layers[layer - 1]).__name__, self._whole_reason)
        if pos is not None and pos.extra_ids and self._layer_tiles_ok[layer - 1]:
            self._unplanned_whole(layer, "a kwarg of its call needs a gradient")
            return False
        return self._layer_tiles_ok[layer - 1]

    def _unplanned_whole(self, layer: int, why: str, *, how: str = "its attention in query "
                         "blocks") -> None:
        """Say once per layer that `layer` runs whole though the plan sized it in tiles."""
        if layer in self._unplanned_said:
            return
        self._unplanned_said.add(layer)
        logger.warning("lazytrain: decoder layer %d (%s) cannot run in sequence tiles (%s); "
                       "it runs whole, %s: its backward working set is the untiled one, "
                       "larger than the plan's (which sized it as tiled from its config)",
                       layer, type(self._layers[layer - 1]).__name__, why, how)

    def _run_layer_tiled(self, layer: int, hidden: torch.Tensor, kwargs: dict[str, Any], *,
                         tile_tokens: int, block_tokens: int, pos: LayerPosition | None
                         ) -> tuple[bool, Any]:
        """(True, output) of `layer` run in sequence tiles, or (False, None) where it
        cannot (said once; it then runs whole)."""
        try:
            with self._shaped(layer, hidden, tile_tokens=tile_tokens, block_tokens=0):
                out, replays = layer_tiles.forward(
                    self._originals[layer - 1], hidden, kwargs, block_tokens=block_tokens,
                    configs=self._attention_configs[layer - 1])
        except layer_tiles.Unsupported as why:
            self._layer_tiles_ok[layer - 1] = False
            self._unplanned_whole(layer, str(why))
            if pos is not None:
                pos.layer_tiled = False
            return False, None
        if pos is not None:
            pos.layer_tiled, pos.tile_replays = True, replays
        return True, out

    def anchor(self, layer: int) -> torch.Tensor:
        return self._anchors[layer - 1]

    def _token_mlp(self, layer: int, tile_tokens: int) -> nn.Module | None:
        """Layer `layer`'s token-wise block to tile, if tiling is on and it has one (said
        once where it has not)."""
        mlp = self._mlps[layer - 1]
        if tile_tokens and mlp is None and not self._untiled_said:
            self._untiled_said = True
            logger.info("lazytrain: decoder layer %d (%s) has no token-wise block the engine "
                        "can find (a child holding most of its non-attention parameters); "
                        "its layers run untiled", layer, type(self._layers[layer - 1]).__name__)
        return mlp

    def _acquire(self, layer: int, prefetch: Sequence[int]) -> None:
        """Put `layer` on its device weights, having started loading `prefetch`, in
        order, behind its own load. The prefetches are issued before the wait for
        `layer`'s weights: where that wait blocks the host (a CPU's compute stream, the
        emulated device), issuing them after it would leave the H2D link idle between two
        layers' loads for the host's issue time (its wake-up and the staging copy); on
        CUDA the wait is the stream's, so the order changes nothing there."""
        self.pool.load(layer)
        for nxt in prefetch:
            if nxt != layer:
                self.pool.prefetch(nxt)
        self.pool.acquire(layer)
        if layer in prefetch:  # asked for again: kept for its next run (B_L on F_L's copy)
            self.pool.prefetch(layer)

    def run_layer(self, layer: int, hidden: torch.Tensor, kwargs: dict[str, Any], *,
                  prefetch: Sequence[int], counter: str, pos: LayerPosition | None = None) -> Any:
        """Run layer `layer`'s own forward on its device weights (no autograd graph kept);
        the layers in `prefetch` start loading, in order, while it computes. For a
        training call (`pos`: its record) whose math depends on the grad mode
        (`quantized.forward_follows_grad_mode`) it runs with grad on, inputs requiring
        grad as the call's did, as the stock forward does; the graph is dropped."""
        stock_grad = pos is not None and forward_follows_grad_mode(self._layers[layer - 1],
                                                                   self.streams.device)
        shape = self.plan if pos is None else pos  # a recompute runs as its forward ran
        # the stock-grad path keeps the layer's own grad-mode-dependent forward: whole
        if stock_grad and self.tiles_layer(layer, hidden):
            self._unplanned_whole(layer, "its forward depends on the grad mode",
                                  how="untiled, attention over the whole sequence")
        tile_tokens = 0 if stock_grad else shape.tile_tokens
        block_tokens = 0 if stock_grad else shape.attention_block_tokens
        self._acquire(layer, prefetch)
        timer = "recompute_s" if counter == "layer_recomputes" else "compute_s"
        try:
            if not stock_grad and self._layer_tiled(layer, hidden, block_tokens, pos, counter):
                with self.acct.timed(timer):
                    done, out = self._run_layer_tiled(layer, hidden, kwargs,
                                                      tile_tokens=tile_tokens,
                                                      block_tokens=block_tokens, pos=pos)
                if done:
                    self.acct.add(counter, 1)
                    return out
            with self.acct.timed(timer), torch.set_grad_enabled(stock_grad), \
                    self._shaped(layer, hidden, tile_tokens=tile_tokens,
                                 block_tokens=block_tokens):
                if stock_grad:
                    hidden, _, kwargs = _grad_inputs(hidden, pos)
                out = self._originals[layer - 1](hidden, **kwargs)
        finally:
            self.pool.release(layer)
        self.acct.add(counter, 1)
        if stock_grad:
            out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        return out

    def rerun_with_grad(self, layer: int, hidden: torch.Tensor, pos: LayerPosition,
                        grad_outs: tuple[torch.Tensor | None, ...], *,
                        prefetch: Sequence[int]) -> tuple[torch.Tensor | None, ...]:
        """Re-run `layer` with grad; return grads of (hidden, *extras); stream weight grads."""
        params = self._trainable[layer - 1]
        self._acquire(layer, prefetch)
        if pos.layer_tiled:
            return self._rerun_tiled(layer, hidden, pos, grad_outs[0], params)
        try:
            with self.acct.timed("compute_s"), replaying(pos.replay), torch.enable_grad(), \
                    recording(pos.captured) as fresh, \
                    self._shaped(layer, hidden, tile_tokens=pos.tile_tokens,
                                 block_tokens=pos.attention_block_tokens):
                h, extras, kwargs = _grad_inputs(hidden, pos)
                out = self._originals[layer - 1](h, **kwargs)
                outs = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
                outs += recorded(fresh, pos.captured)  # the Function's extra outputs, in order
                pairs = [(o, g) for o, g in zip(outs, grad_outs, strict=False)
                         if g is not None and o.requires_grad]
                inputs = ([h] if pos.hidden_requires_grad else []) + extras + params
                grads: tuple[torch.Tensor | None, ...] = (None,) * len(inputs)
                if pairs and inputs:
                    grads = torch.autograd.grad([o for o, _ in pairs], inputs,
                                                [g for _, g in pairs], allow_unused=True)
        finally:
            self.pool.release(layer)
        param_grads = grads[len(inputs) - len(params):]
        kept = [(p, g) for p, g in zip(params, param_grads, strict=True) if g is not None]
        self.sink.put([p for p, _ in kept], [g for _, g in kept])
        self.acct.add("layer_backwards", 1)
        grad_hidden = grads[0] if pos.hidden_requires_grad else None
        first_extra = 1 if pos.hidden_requires_grad else 0
        return (grad_hidden, *grads[first_extra:first_extra + len(extras)])

    def own_grad(self, grad: torch.Tensor) -> None:
        """Record `grad` as a gradient only the engine holds (see `_owned`)."""
        self._owned = weakref.ref(grad)

    def _rerun_tiled(self, layer: int, hidden: torch.Tensor, pos: LayerPosition,
                     grad_out: torch.Tensor | None, params: list[nn.Parameter]
                     ) -> tuple[torch.Tensor | None, ...]:
        """`rerun_with_grad` of a layer whose forward ran in sequence tiles (`layer_tiles`;
        its weights acquired): no kwarg needs a gradient there."""
        reuse = (self._owned is not None and grad_out is not None
                 and self._owned() is grad_out and layer_tiles.can_reuse(grad_out, hidden))
        self._owned = None
        try:
            with self.acct.timed("compute_s"), replaying(pos.replay), \
                    self._shaped(layer, hidden, tile_tokens=pos.tile_tokens, block_tokens=0):
                grad_hidden, param_grads = layer_tiles.backward(
                    self._originals[layer - 1], hidden,
                    pytree.tree_unflatten(pos.leaves, pos.spec), grad_out, params,
                    block_tokens=pos.attention_block_tokens,
                    configs=self._attention_configs[layer - 1], replays=pos.tile_replays,
                    hidden_grad=pos.hidden_requires_grad, reuse_grad=reuse)
        finally:
            self.pool.release(layer)
        if grad_hidden is not None:
            self.own_grad(grad_hidden)
        kept = [(p, g) for p, g in zip(params, param_grads, strict=True) if g is not None]
        self.sink.put([p for p, _ in kept], [g for _, g in kept])
        self.acct.add("layer_backwards", 1)
        return (grad_hidden,)


def _grad_inputs(hidden: torch.Tensor, pos: LayerPosition
                 ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, Any]]:
    """Detached inputs of the call `pos` requiring grad as its own did: the hidden state,
    the extras (kwargs that required grad) and the kwargs holding them."""
    h = hidden.detach().requires_grad_(pos.hidden_requires_grad)
    leaves = list(pos.leaves)
    extras = [leaves[k].detach().requires_grad_() for k in pos.extra_ids]
    for k, extra in zip(pos.extra_ids, extras, strict=True):
        leaves[k] = extra
    return h, extras, pytree.tree_unflatten(leaves, pos.spec)
