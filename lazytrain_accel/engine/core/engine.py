"""`StreamingEngine`: attaches to a HF causal LM and runs its decoder layers per a `Plan`.

The model's own forward, masks, rotary embeddings, loss and `loss.backward()` stay
untouched: only each decoder layer's `forward` is replaced (on the instance) by a call
through the layer Function, and hooks bracket each model pass (`patching.py`). This module
owns the pass bracketing (`before_model`, `new_pass`, `before_head`), the layer calls
(`call_layer`), the backward's start and end (`_begin_backward`, `_finish_backward`) and
the public queries. The life of one step, function by function: docs/engine.md "The life
of one step, in the code" and docs/architecture.md "The life of one step".
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from lazytrain_accel.engine.core.layer_call import ForwardState
from lazytrain_accel.engine.core.runtime import Runtime
from lazytrain_accel.engine.device.backends import make_streams
from lazytrain_accel.engine.device.emulation import EmulationSettings
from lazytrain_accel.engine.loss.loss_patch import FusedLoss, apply_fused_loss
from lazytrain_accel.engine.memory import quantized
from lazytrain_accel.engine.memory.copy_files import NvmeCopies
from lazytrain_accel.engine.memory.grad_files import NvmeGrads
from lazytrain_accel.engine.memory.grads import GradSink
from lazytrain_accel.engine.memory.nvme import NvmeSpill
from lazytrain_accel.engine.memory.optimizer_files import NvmeMasters
from lazytrain_accel.engine.memory.residents import ResidentParams, owners, update_groups
from lazytrain_accel.engine.memory.state_io import StateIO
from lazytrain_accel.engine.memory.weights import NodeCopies, master_dtype
from lazytrain_accel.engine.model import hf_checkpointing
from lazytrain_accel.engine.model.binding import bind_call, drop_cache
from lazytrain_accel.engine.model.discovery import find_decoder_layers
from lazytrain_accel.engine.model.patching import ModelPatch, move_buffers, restore_buffers
from lazytrain_accel.engine.sequence import long_sequence
from lazytrain_accel.engine.stats import Accounting, StepStats
from lazytrain_accel.engine.step.coordinator import StepCoordinator
from lazytrain_accel.engine.step.overlap import LayerwiseOptimizer
from lazytrain_accel.planning.plan import Home, Plan
from lazytrain_accel.planning.slots import weight_slots
from lazytrain_accel.profiling.whole_layers import whole_layer_reason

logger = logging.getLogger("lazytrain_accel")


class StreamingEngine:
    def __init__(self, model: nn.Module, plan: Plan, *, device: torch.device,
                 compute_dtype: torch.dtype | None, nvme_dir: str | None,
                 loss_chunk_tokens: int | str = 0,
                 emulation: EmulationSettings | bool | None = None,
                 node_copies: NodeCopies | None = None) -> None:
        if loss_chunk_tokens != "auto" and (not isinstance(loss_chunk_tokens, int)
                                            or loss_chunk_tokens < 0):
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens!r} must be an integer >= 0 "
                             "(0 = the model's own loss) or 'auto' (the plan's)")
        parent, layers_attr, layers = find_decoder_layers(model)
        if plan.num_layers != len(layers):
            raise ValueError(f"plan.num_layers={plan.num_layers} but the model has "
                             f"{len(layers)} decoder layers; plan for this model")
        self.model, self.plan, self.device = model, plan, torch.device(device)
        self._checkpointing_said = False
        if hf_checkpointing.turn_off(model):
            self._absorb_checkpointing()
        self._checkpointing_patched = hf_checkpointing.keep_off(model, self._absorb_checkpointing)
        self.compute_dtype = compute_dtype or torch.float32
        self._layers = list(layers)
        self._stack_signature = inspect.signature(parent.forward)
        early, *self._layer_params, late = update_groups(model, parent, layers_attr,
                                                         self._layers)
        self._buffer_devices = move_buffers(model, self.device)
        #: the compute copies a node store holds for the layers whose masters the plan
        #: homes on NVMe (their owners' drives), or None (this process holds every master)
        self.node_copies = node_copies
        self._check_state(plan, reduce_hooks=False)
        homed = {p for j in self._homed_here(plan) for p in self._layer_params[j - 1]
                 if p.requires_grad}
        for p in model.parameters():  # fp32 host masters; frozen weights stay as stored
            if quantized.is_packed(p):
                quantized.packed_to_host(p)
            elif p not in homed:  # cast layer by layer as they go to their files
                _to_master(p)
        self.streams = make_streams(self.device, emulation)
        self._build_parts(nvme_dir, early + late, late)
        self._state_dict_hooks = [layer.register_state_dict_post_hook(
            self.masters.module_hook(layer, j)) for j, layer in enumerate(self._layers, 1)]
        for j in self._homed_here(plan):
            self._evict_masters(j)
        self._model_patch = ModelPatch(self, model, parent, self._layers, self.residents.params,
                                       head_modules=owners(model, self.residents.late))
        self.fused_loss: FusedLoss | None = None
        self._loss_chunk_from_plan = loss_chunk_tokens == "auto"
        self._set_loss_chunk(plan.loss_chunk_tokens if self._loss_chunk_from_plan
                             else int(loss_chunk_tokens))

    def _set_loss_chunk(self, chunk_tokens: int) -> None:
        """The training loss: fused with `chunk_tokens` tokens per chunk, or (0) the
        model's own. A change applies from the next head call."""
        if self.fused_loss is not None and chunk_tokens:
            self.fused_loss.chunk_tokens = chunk_tokens
        elif self.fused_loss is not None:
            self.fused_loss.remove()
            self.fused_loss = None
        elif chunk_tokens:
            self.fused_loss = apply_fused_loss(self.model, chunk_tokens=chunk_tokens)

    def _evict_masters(self, layer: int, state: Mapping[nn.Parameter, dict[str, Any]] |
                       None = None) -> None:
        """Send layer `layer`'s masters (cast here, from the model's own weights) and their
        optimizer `state` to their file, after its compute copy is made from them: the
        forward streams the copy."""
        if not any(p.requires_grad for p in self._layer_params[layer - 1]):
            return  # a frozen layer: no master, no moments
        for p in self._layer_params[layer - 1]:
            _to_master(p)
        self.pool.compute_copy(layer)
        self.masters.evict(layer, state)
        self.pool.compute_copy_written(layer)

    @contextlib.contextmanager
    def masters_in_dram(self, optimizer: torch.optim.Optimizer | None = None
                        ) -> Iterator[None]:
        """Within: every master and moment homed on NVMe (those of `optimizer`, or of the
        optimizer the engine last stepped) is back in DRAM in its own tensors, for a
        checkpoint's save or load to read or write in place (no update runs); after it,
        each goes back to its file, its compute copy cast again from it."""
        self.steps.wait()
        evicted = self.masters.evicted_layers
        state = optimizer.state if optimizer is not None else None
        for j in evicted:
            self.masters.restore(j, state)
        try:
            yield
        finally:
            for j in evicted:  # the state as it is now: a load may have replaced it
                if j in self.masters.layers:
                    self._evict_masters(j, optimizer.state if optimizer is not None else None)

    def _nvme_copies(self) -> NvmeCopies | None:
        """The files of the compute copies the plan homes on NVMe (`Plan.state`), under
        this engine's NVMe directory; None where the compute keeps no copies (fp32)."""
        if self.compute_dtype == torch.float32:
            return None
        return NvmeCopies(self.spill.state_dirs, set(self.plan.state.copies),
                          self.acct, self.state_io, claim_root=self.spill.claim)

    def _check_state(self, plan: Plan, *, reduce_hooks: bool) -> None:
        """Refuse a plan homing on NVMe gradients where a data-parallel hook reads them
        after the fold, or copies (or masters, which the device then streams) where an
        fp32 run keeps no copies."""
        state = plan.state
        if self.node_copies is not None:
            self._check_node_copies(plan)
        if state.grads and reduce_hooks:
            raise ValueError(
                f"the plan homes gradients on NVMe (layers {list(state.grads)}) but a hook "
                "reduces them across ranks once folded, which needs them in DRAM: with "
                "several ranks plan with host_state='copies'")
        if state.copies and self.compute_dtype == torch.float32:
            raise ValueError(f"the plan homes compute copies on NVMe (layers {state.copies}) "
                             "but this run computes in fp32, which keeps none; plan for the "
                             "run's compute dtype")
        if state.optimizer and self.compute_dtype == torch.float32:
            raise ValueError(f"the plan homes masters and moments on NVMe (layers "
                             f"{state.optimizer}) but this run computes in fp32, whose "
                             "device streams the masters themselves; plan for the run's "
                             "compute dtype (bf16 streams a copy of them)")

    def _check_node_copies(self, plan: Plan) -> None:
        """A plan this engine can run with the node store's copies: it homes on NVMe the
        masters of the layers the store holds as copies (fixed when the store was laid
        out), and no copy of them."""
        held = set(self.node_copies.copies)
        if set(plan.state.optimizer) != held:
            raise ValueError(
                f"the plan homes the masters and moments of layers {list(plan.state.optimizer)}"
                f" on NVMe, but the node store was laid out for layers {sorted(held)} "
                "(their compute copies shared by the node's ranks); a plan of the local "
                "ranks keeps the homes it started with: restart the launch to change them")
        both = held & set(plan.state.copies)
        if both:
            raise ValueError(f"the plan homes the compute copies of layers {sorted(both)} on "
                             "NVMe, which the node store holds for every local rank; plan "
                             "their copies in DRAM (host_state='auto' does)")

    def _homed_here(self, plan: Plan) -> list[int]:
        """The layers whose masters and moments this process homes on its drive: the
        plan's, but those another process of the node updates (`NodeCopies.foreign`)."""
        foreign = self.node_copies.foreign if self.node_copies is not None else frozenset()
        return [j for j in plan.state.optimizer if j not in foreign]

    def _absorb_checkpointing(self) -> None:
        """HF checkpointing was requested: keep it off; say once who decides recompute."""
        hf_checkpointing.turn_off(self.model)
        if not self._checkpointing_said:
            self._checkpointing_said = True
            recomputed = sum(h == Home.RECOMPUTE for h in self.plan.homes)
            logger.info("lazytrain: HF gradient checkpointing is off on the streamed model: "
                        "the plan decides recompute (%d of %d layer inputs recomputed, the "
                        "rest stored)", recomputed, self.plan.num_layers)

    def _build_parts(self, nvme_dir: str | None, resident: list[nn.Parameter],
                     late: list[nn.Parameter]) -> None:
        self.acct = Accounting(clock=self.streams)  # device work timed where it runs
        self.spill = NvmeSpill(nvme_dir, self.acct, streams=self.streams)
        #: The one direct-I/O of the state files (compute copies, gradients) on NVMe.
        self.state_io = StateIO(self.acct, pace=self.streams.io_link)
        trainable = [[p for p in ps if p.requires_grad] for ps in self._layer_params]
        max_numel = max((sum(p.numel() for p in ps) for ps in trainable), default=1)
        self.sink = GradSink(streams=self.streams, accounting=self.acct,
                             max_numel=max(max_numel, 1), grad_dtype=self.compute_dtype)
        self.sink.files = NvmeGrads(self.spill.state_dirs, set(self.plan.state.grads),
                                    trainable, self.acct, self.state_io,
                                    claim_root=self.spill.claim)
        #: The masters and moments of the layers the plan homes on NVMe.
        self.masters = NvmeMasters(self.spill.state_dirs,
                                   set(self._homed_here(self.plan)), trainable, self.acct,
                                   self.state_io, claim_root=self.spill.claim)
        self.pool = quantized.weight_pool(self._layer_params, streams=self.streams,
                                          compute_dtype=self.compute_dtype,
                                          accounting=self.acct,
                                          is_ready=lambda j: self.steps.is_group_updated(j),
                                          wait_ready=lambda j: self.steps.wait_for_group(j),
                                          num_slots=weight_slots(self.plan),
                                          nvme_copies=self._nvme_copies())
        self.pool.masters_generation = self.masters.generation
        if self.node_copies is not None:
            shared = self.node_copies.copies
            self.pool.share_copies({j: shared[j] for j in self.node_copies.updated_here})
            self.pool.receive_copies({j: shared[j] for j in self.node_copies.foreign})
        self.residents = ResidentParams(resident, late=late, device=self.device,
                                        compute_dtype=self.compute_dtype, sink=self.sink,
                                        accounting=self.acct,
                                        device_masters=self.plan.resident_update == "device")
        self._originals = [layer.forward for layer in self._layers]
        self._signatures = [inspect.signature(f) for f in self._originals]
        self.runtime = Runtime(plan=self.plan, layers=self._layers, originals=self._originals,
                               trainable=trainable,
                               streams=self.streams, acct=self.acct, spill=self.spill,
                               pool=self.pool, sink=self.sink,
                               whole_layer_reason=whole_layer_reason(
                                   getattr(self.model, "config", None) or {}))
        self._state: ForwardState | None = None
        self._open: weakref.WeakSet[ForwardState] = weakref.WeakSet()
        self._latest: weakref.ref[ForwardState] | None = None
        self._backwarded: list[ForwardState] = []
        self._finalizer_task: int | None = None  # backward (graph task) with our callback
        last = len(self._layers) + 1
        #: Begin, wait and end of each optimizer step (`engine/step/coordinator.py`).
        self.steps = StepCoordinator(
            groups=[self.residents.early, *self._layer_params, self.residents.late],
            device_groups=(0, last) if self.residents.on_device else (), copies=self.pool,
            accounting=self.acct, device_update_beside_host=self.streams.is_async,
            grad_sq_norms=self.grad_sq_norms,
            awaiting_backward=lambda: bool(self._open) or self.residents.active)
        self.steps.grad_files = self.sink.files
        self.steps.master_files = self.masters
        self._shape_warned = False
        self._mask_verdicts: dict[tuple[int, int], bool] = {}  # 4-D mask: plain causal?
        #: `replan(batch, seq) -> Plan | None`, asked before a batch beyond the plan runs
        self.replan: Callable[[int, int], Plan | None] | None = None
        #: `agree_shape(batch, seq) -> (batch, seq)`: the largest any rank runs now, so
        #: that the ranks of a launch re-plan together (None: one process)
        self.agree_shape: Callable[[int, int], tuple[int, int]] | None = None

    # ---- model pass bracketing -------------------------------------------------------
    def before_model(self) -> None:
        self.steps.wait_for_group(0)  # the input side's residents are updated first
        if self.residents.active and not self._open:
            self.residents.swap_out()  # a previous pass never ran (or failed) its backward
        self.residents.swap_in()

    def before_head(self) -> None:
        """A module of the output side (final norm, head) is about to run: its update
        (the last group) is done and its device copies are in."""
        self.steps.wait_for_group(len(self._layers) + 1)
        self.residents.swap_in_late()

    def after_model(self) -> None:
        """The model's call ended, or failed before its end: the residents' masters go
        back in place unless a pass still awaits its backward."""
        if not self._open:
            self.residents.swap_out()

    def new_pass(self) -> None:
        self.pool.invalidate()  # an optimizer may have updated the masters since
        for state in self._backwarded:  # left by a backward that raised
            state.close()
        self._backwarded.clear()
        self._state = None
        self._mask_verdicts.clear()

    def end_pass(self) -> None:
        self._state = None

    def check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The decoder stack's call, before it builds its masks: refuse the inputs from
        which it would build an S x S one (`long_sequence.check_inputs`)."""
        try:
            arguments = self._stack_signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return  # the stack's own forward raises the precise error
        config = getattr(self.model, "config", None)
        try:
            long_sequence.check_inputs(arguments, attn_implementation=getattr(
                config, "_attn_implementation", None))
        except long_sequence.LongSequenceError:
            self.after_model()  # it won't run: the error skips the model's end
            raise

    # ---- layer calls -----------------------------------------------------------------
    def call_layer(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        layer = self._layers[index - 1]
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            raise ValueError(f"gradient_checkpointing was set by hand on streamed layer {index}; "
                             "the engine re-runs layers itself: set it back to False (or use "
                             "model.gradient_checkpointing_enable(), which LazyTrain absorbs)")
        hidden, call_kwargs = bind_call(self._signatures[index - 1], index, args, kwargs)
        config = getattr(self.model, "config", None)
        try:
            long_sequence.check_call(hidden, call_kwargs, verdicts=self._mask_verdicts,
                                     attn_implementation=getattr(config, "_attn_implementation",
                                                                 None),
                                     tiled=self.runtime.tiles_layer(index, hidden))
        except long_sequence.LongSequenceError:
            self.after_model()  # it won't run: the error skips the model's end
            raise
        trainable = any(p.requires_grad for p in self._layer_params[index - 1])
        if not torch.is_grad_enabled() or not (trainable or hidden.requires_grad):
            return self.runtime.run_layer(index, hidden, call_kwargs, prefetch=(index + 1,),
                                          counter="layer_forwards")
        drop_cache(call_kwargs)
        if index == 1:
            self._check_planned_tokens(hidden)
        if self._state is None:
            self._state = ForwardState(self.runtime, begin_backward=self._begin_backward)
            self._open.add(self._state)
            self._latest = weakref.ref(self._state)
            weakref.finalize(self._state, self._state.store.close)
        state = self._state
        try:
            return state.call(index, hidden, call_kwargs)
        except BaseException:  # the state closed itself; it awaits no backward any more
            self._open.discard(state)
            self._state = None
            self.after_model()  # it won't run: the error skips the model's end
            raise

    def _check_planned_tokens(self, hidden: torch.Tensor) -> None:
        """A training batch with more tokens than the plan was sized for outgrows its
        planned bytes: re-plan (`replan`, set by the front end) before it runs, else warn."""
        plan = self.plan
        batch = hidden.shape[0] if hidden.dim() > 2 else 1
        seq = hidden.numel() // hidden.shape[-1] // batch
        if self.agree_shape is not None:
            batch, seq = self.agree_shape(batch, seq)
        if batch * seq <= plan.batch_size * plan.seq_len:
            return
        new = self.replan(batch, seq) if self.replan is not None else None
        if new is not None:
            self.set_plan(new)
            return
        if self._shape_warned:
            return
        self._shape_warned = True
        where = ("may not fit the GPU" if self.device.type == "cuda"
                 else "the plan's memory figures no longer hold")
        logger.warning(
            "lazytrain: a training batch of %d x %d tokens is beyond the plan's %d x %d; its "
            "activations exceed the planned memory: %s. Plan for the longest batch "
            "(LazyTrainPlugin(batch_size=..., seq_len=...) or `lazytrain plan --batch-size "
            "--seq-len`).", batch, seq, plan.batch_size, plan.seq_len, where)

    def set_plan(self, plan: Plan) -> None:
        """Run the next forward passes with `plan` (same model; e.g. sized for longer
        batches), its loss head too where the engine's follows the plan (attached with
        loss_chunk_tokens="auto"). Passes already awaiting their backward keep the plan
        they ran with."""
        if plan.num_layers != self.plan.num_layers:
            raise ValueError(f"plan.num_layers={plan.num_layers} but the model has "
                             f"{self.plan.num_layers} decoder layers; plan for this model")
        self._check_state(plan, reduce_hooks=bool(self.sink.ready_hooks))
        if plan.resident_update != self.plan.resident_update:
            raise ValueError(f"the new plan updates the residents on the {plan.resident_update}"
                             f", this engine on the {self.plan.resident_update} (fixed at "
                             f"attach); plan with resident_update="
                             f"{self.plan.resident_update!r}")
        self.runtime.set_plan(plan)  # refuses query blocks the layers cannot run
        self.plan = plan
        self.pool.grow(weight_slots(plan))
        self.pool.home_copies(set(plan.state.copies))
        self.sink.files.set_layers(set(plan.state.grads))
        if set(self._homed_here(plan)) != self.masters.layers:
            self.steps.wait()  # no update stages a layer while its home changes
            self.masters.set_layers(self._homed_here(plan))
        if self._loss_chunk_from_plan:
            self._set_loss_chunk(plan.loss_chunk_tokens)

    # ---- backward bookkeeping --------------------------------------------------------
    def _begin_backward(self, state: ForwardState) -> None:
        if not state.backwarded:
            state.backwarded = True
            self._open.discard(state)
            self._backwarded.append(state)
        self.steps.wait()  # gradients of this pass must not meet a running update
        self.queue_finalizer()

    def defer_zero_grad(self, set_to_none: bool) -> bool:
        return self.steps.defer_zero_grad(set_to_none)

    def wait_for_reads(self) -> None:
        self.steps.wait_for_reads()

    def queue_finalizer(self) -> None:
        # Keyed by graph task: a backward that raised never ran its callback, and the
        # next backward must queue its own.
        task = torch._C._current_graph_task_id()
        if self._finalizer_task != task:
            self._finalizer_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of a backward pass: land gradients, close its states, free the residents."""
        self._finalizer_task = None
        self.sink.drain()
        states, self._backwarded = self._backwarded, []
        for state in states:
            state.close()
        if not self._open:
            self.residents.swap_out()
        for state in states:
            state.store.check_writes()

    # ---- optimizer step --------------------------------------------------------------
    def step_layerwise(self, optimizer: LayerwiseOptimizer) -> bool:
        """`optimizer.step()` through the engine: the update starts layer by layer in
        forward order and this returns (False: a non-finite step, skipped); see
        `StepCoordinator.step`. `optimizer` implements `LayerwiseOptimizer`
        (HybridAdamW8bit does). The next forward of layer j waits only for layer j's
        update; the next backward, `synchronize()` and state reads wait for all of it."""
        return self.steps.step(optimizer)

    # ---- public queries --------------------------------------------------------------
    def layer_params(self, j: int) -> list[nn.Parameter]:
        """Parameters of decoder layer `j` (1-based)."""
        if not 1 <= j <= len(self._layers):
            raise ValueError(f"layer j={j} outside 1..{len(self._layers)}")
        return list(self._layer_params[j - 1])

    def resident_params(self) -> list[nn.Parameter]:
        """Parameters outside the decoder layers (embeddings, final norm, head)."""
        return list(self.residents.params)

    def grad_sq_norms(self) -> dict[nn.Parameter, float]:
        """Squared L2 norm of each parameter's accumulated `.grad`, kept as grads landed."""
        self.sink.drain()
        files = self.sink.files
        return {p: sq for p, sq in self.sink.sq_norms.items()
                if p.grad is not None or files.holds(p)}

    def refresh_grad_sq_norms(self, params: list[nn.Parameter]) -> None:
        """Re-measure the recorded norms of `params` whose `.grad` was rewritten outside
        the engine (a data-parallel all-reduce), so clipping and the non-finite guard see
        the gradients the optimizer will apply."""
        self.sink.drain()
        self.sink.record_norms([p for p in params
                                if p in self.sink.sq_norms and p.grad is not None])

    def scale_grad_sq_norms(self, factor: float) -> None:
        """Multiply the recorded squared norms by `factor` after every `.grad` was scaled
        by its square root (fp16 loss scaling undone: factor = 1 / scale**2, exact for a
        power-of-two scale)."""
        self.sink.drain()
        for p in self.sink.sq_norms:
            self.sink.sq_norms[p] *= factor

    def release_grads(self, params: list[nn.Parameter]) -> None:
        """Drop the `.grad` of `params` and the host storage the engine keeps for them
        across steps (`GradSink.owned_grad`): for a rank that hands its gradients away
        (the split update's non-owners), whose host holds no copy of them."""
        self.sink.release(params)

    def record_grad_sq_norms(self, params: list[nn.Parameter]) -> None:
        """Record the squared norms of `params`' current `.grad` now (residents used in
        place, whose norms the end of the pass records: for a reducer that sends them
        earlier)."""
        self.sink.record_norms(params)

    def register_grad_ready_hook(self, hook: Callable[[list[nn.Parameter]], None]) -> None:
        """Call `hook(params)` each time a streamed layer's gradients have been folded
        into the host `.grad` of `params` (once per layer per backward pass)."""
        self._check_reducible()
        self.sink.ready_hooks.append(hook)

    def register_grad_taker(self, taker: Callable[[list[nn.Parameter], list[torch.Tensor]],
                                                  Future[None] | None]) -> None:
        """Offer each layer's landed host gradients to `taker(params, grads)` before they
        are folded into `.grad`; where it returns a Future it has taken them (never
        `.grad`), and reads them until that is done (`GradSink.taker`)."""
        self._check_reducible()
        self.sink.taker = taker

    def _check_reducible(self) -> None:
        if self.plan.state.grads:
            raise ValueError(
                f"the plan homes gradients on NVMe (layers {list(self.plan.state.grads)}) but "
                "a hook would reduce them across ranks once folded, which needs them in "
                "DRAM: with several ranks plan with host_state='copies'")

    def stats(self) -> StepStats:
        return self.acct.snapshot()

    def reset_stats(self) -> None:
        self.acct.reset()

    def total_stats(self) -> StepStats:
        """What the engine measured since attach; `reset_stats()` leaves it alone."""
        return self.acct.totals()

    def boundary_tiers(self) -> dict[int, set[str]]:
        """Where each boundary stored by the latest forward awaiting backward lives now."""
        state = self._latest() if self._latest is not None else None
        if state is None or state.backwarded:
            return {}
        return {i: state.store.where(i) for i in range(len(state.positions))
                if state.store.where(i)}

    def synchronize(self) -> None:
        """Wait for background I/O and a running layer-wise update."""
        self.steps.wait()
        if self._state is not None:
            self._state.store.sync()
        for state in list(self._open):
            state.store.sync()
        self.spill.flush()

    def detach(self) -> None:
        """Restore the model: own forwards, masters in place, buffers where they were."""
        self.synchronize()
        try:  # every master and moment back in DRAM, the files removed
            self.masters.close()
        finally:
            self._release()

    def _release(self) -> None:
        """The rest of `detach`, done whether the masters came back or not."""
        for hook in self._state_dict_hooks:
            hook.remove()
        self.residents.swap_out()
        self.residents.masters_to_host()
        if self.fused_loss is not None:
            self.fused_loss.remove()
        self._model_patch.restore()
        hf_checkpointing.restore(self._checkpointing_patched)
        restore_buffers(self._buffer_devices)
        self.pool.close()
        self.sink.close()
        self.state_io.close()
        self.spill.close()
        self.streams.close()
        self.steps.close()


def _to_master(p: nn.Parameter) -> None:
    """`p` as its host master: fp32 for a trainable float, else its stored dtype."""
    if p.device.type != "cpu" or p.dtype != master_dtype(p):
        p.data = p.data.to("cpu", master_dtype(p))


def attach(model: nn.Module, plan: Plan, *, device: torch.device,
           compute_dtype: torch.dtype | None = None,
           nvme_dir: str | None = None, loss_chunk_tokens: int | str = 0,
           emulation: EmulationSettings | bool | None = None,
           node_copies: NodeCopies | None = None) -> StreamingEngine:
    """Stream `model`'s decoder layers per `plan` on `device`; see `StreamingEngine`.

    `plan.num_layers` must equal the decoder depth. `compute_dtype` (default fp32) is the
    dtype of the device copies; masters stay fp32 on the host. Boundaries homed on NVMe
    go to a private directory under `nvme_dir` (default: the system temp directory).
    `loss_chunk_tokens` > 0 computes the training loss with the fused chunked
    cross-entropy (`apply_fused_loss`; docs/engine.md "Fused loss"); "auto" takes the
    plan's (`Plan.loss_chunk_tokens`), and a new plan's on `set_plan`. On a CPU,
    `emulation` selects the emulated async device (`engine/device/emulation.py`; None: from
    `LAZYTRAIN_EMULATE_ASYNC`, False: synchronous). `node_copies`: the node store's
    compute copies of the layers whose masters the plan homes on NVMe, and which of them
    this process updates (the others' masters are placeholders here).
    """
    return StreamingEngine(model, plan, device=device, compute_dtype=compute_dtype,
                           nvme_dir=nvme_dir, loss_chunk_tokens=loss_chunk_tokens,
                           emulation=emulation, node_copies=node_copies)
