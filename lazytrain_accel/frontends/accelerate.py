"""`Accelerator(..., plugin=LazyTrainPlugin(...))`: a drop-in subclass of accelerate's.

Stock `accelerate.Accelerator` rejects unknown keywords and its kwargs-handler table is
closed, so LazyTrain ships a subclass. Without `plugin=` it is the stock Accelerator.
With it, `prepare` profiles, plans, attaches the streaming engine and swaps the optimizer;
the model is never moved to the device whole and never wrapped in DDP.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import accelerate
import torch
from torch import nn

from lazytrain_accel.checkpoints import asynchronous as async_checkpoint
from lazytrain_accel.checkpoints.atomic import atomic_directory, recover, recover_all
from lazytrain_accel.checkpoints.share_format import read_manifest
from lazytrain_accel.config import LazyTrainConfig
from lazytrain_accel.distributed.grad_reduce import clip_shares
from lazytrain_accel.frontends import share_checkpoint
from lazytrain_accel.run import setup
from lazytrain_accel.run.state import Launch, RunState, build_run_state
from lazytrain_accel.run.step import OptimizerStep, installed_step, update_overlaps

if TYPE_CHECKING:
    from lazytrain_accel.planning import Plan

logger = logging.getLogger("lazytrain_accel")

PLAN_FILE = "lazytrain_plan.json"
_FOREIGN_PLUGINS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin")
_FOREIGN_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator plus `plugin: LazyTrainPlugin | None`."""

    #: Ctrl-C raises `TrainingInterrupted` at the step boundary (a Trainer stops instead).
    _lazytrain_interrupt_raises = True

    def __init__(self, *args: Any, plugin: LazyTrainConfig | None = None, **kwargs: Any) -> None:
        if plugin is not None:
            _refuse_foreign_plugins(kwargs)
        super().__init__(*args, **kwargs)
        self.lazytrain_plugin = plugin
        #: the run's state: plan, engine, guard, re-planner, node store (None before prepare)
        self.lazytrain: RunState | None = None
        #: a sequence bound the front end knows (the Trainer sets TRL's max_length).
        self.lazytrain_seq_bound: int | None = None

    # ---- prepare --------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.lazytrain_plugin is None:
            return super().prepare(*args, device_placement=device_placement)
        models = [a for a in args if isinstance(a, nn.Module)]
        streamed = self.lazytrain.model if self.lazytrain is not None else None
        if len(models) > 1 or (models and streamed not in (None, models[0])):
            raise ValueError("LazyTrain streams exactly one model per Accelerator; prepare "
                             "other models with a stock accelerate.Accelerator.")
        if models and streamed is None:  # a second prepare() of it is a no-op
            loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
            self._lazytrain_prepare_model(models[0], loaders[0] if loaders else None)
        out = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = self._lazytrain_prepare_optimizer(obj)
        # Data loaders and schedulers go through the stock path (sharding, step counting).
        rest = [i for i, o in enumerate(out)
                if not isinstance(o, (nn.Module, torch.optim.Optimizer))]
        prepared = super().prepare(*[out[i] for i in rest]) if rest else ()
        prepared = prepared if isinstance(prepared, tuple) else (prepared,)
        for i, obj in zip(rest, prepared, strict=True):
            out[i] = obj
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        if self.lazytrain is not None and model is self.lazytrain.model:
            return model  # streamed already: never move it to the device whole
        return super().prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=evaluation_mode)

    def _lazytrain_prepare_optimizer(self, optimizer: torch.optim.Optimizer
                                     ) -> accelerate.optimizer.AcceleratedOptimizer:
        if self.lazytrain is None:
            raise ValueError("prepare the model before (or together with) its optimizer: "
                             "LazyTrain rebuilds the optimizer on the streamed model's host "
                             "masters")
        if isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
            if optimizer.optimizer is self.lazytrain.optimizer:
                return optimizer  # already ours and prepared
            optimizer = optimizer.optimizer
        self.lazytrain.optimizer = setup.build_optimizer(self.lazytrain_plugin, optimizer,
                                                         self.lazytrain.model)
        # before accelerate's prepare: with a loss scaler it keeps `optimizer.step`
        step = self._lazytrain_overlap(self.lazytrain.optimizer, replaced=optimizer)
        prepared = super().prepare_optimizer(self.lazytrain.optimizer, device_placement=False)
        step.on_boundary = lambda skipped: self._lazytrain_stepped(prepared, skipped)
        return prepared

    def _lazytrain_stepped(self, prepared: accelerate.optimizer.AcceleratedOptimizer,
                           skipped: bool) -> None:
        """A step boundary: tell accelerate whether the step was skipped (its schedulers
        and the Trainer consult `step_was_skipped`); the re-planner may switch plans."""
        prepared._is_overflow = skipped
        if self.lazytrain.replanner is not None:
            self.lazytrain.replanner.on_step()

    def _lazytrain_overlap(self, optimizer: torch.optim.Optimizer,
                           replaced: torch.optim.Optimizer) -> OptimizerStep:
        """`optimizer.step()` becomes the run's `OptimizerStep` (`run/step.py`): with the
        hybrid operator (and `overlap_step`) it starts the engine's layer-wise update on
        its thread and returns; reading or loading the optimizer's state first waits for
        that update to end."""
        from lazytrain_accel.optim import HybridAdamW8bit

        optimizer.register_state_dict_pre_hook(lambda _: self._lazytrain_synchronize())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self._lazytrain_synchronize())
        state = self.lazytrain
        # optimizer="keep" (any torch optimizer) steps serially, inline
        plugin = self.lazytrain_plugin
        overlapped = isinstance(optimizer, HybridAdamW8bit) and update_overlaps(
            plugin.overlap_step, device=self.device, emulated=bool(plugin.emulate_async))
        step = OptimizerStep(guard=state.guard, engine=state.engine, overlapped=overlapped,
                             shares=state.reducer if state.store is not None else None)
        step.install(optimizer, replaced=replaced)
        return step

    def _lazytrain_synchronize(self) -> None:
        if self.lazytrain is not None:
            self.lazytrain.synchronize()

    def _lazytrain_prepare_model(self, model: nn.Module, loader: Any) -> None:
        # config.use_cache stays as the user set it: the engine strips KV caches from
        # training calls itself, and the config is what save_pretrained writes.
        self.lazytrain = build_run_state(self.lazytrain_plugin, model, loader,
                                         launch=self._lazytrain_launch())
        if self.native_amp:
            _wrap_forward_in_autocast(model)
        model._is_accelerate_prepared = True
        self._models.append(model)

    def _lazytrain_launch(self) -> Launch:
        return Launch(num_processes=self.num_processes,
                      local_process_index=self.local_process_index,
                      is_main_process=self.is_main_process, device=self.device,
                      mixed_precision=self.mixed_precision,
                      interrupt_raises=self._lazytrain_interrupt_raises,
                      seq_bound=self.lazytrain_seq_bound,
                      should_reduce=lambda: self.sync_gradients,
                      synchronize=self._lazytrain_synchronize)

    # ---- the training step ----------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)
        reducer = self.lazytrain.reducer if self.lazytrain is not None else None
        if reducer is not None and self.sync_gradients:
            reducer.finish()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Global gradient norm; with the hybrid operator, clipping happens inside its
        fused update (the gradients are not touched here, so nothing is clipped twice).
        fp16 loss scaling is undone first, as stock does, and the norms the engine
        recorded as the scaled gradients landed are rescaled with it."""
        from lazytrain_accel.optim import HybridAdamW8bit

        state = self.lazytrain
        optimizer = state.optimizer if state is not None else None
        if isinstance(optimizer, HybridAdamW8bit):
            if norm_type != 2:
                raise ValueError(f"norm_type={norm_type}: the hybrid 8-bit operator clips by "
                                 "the L2 norm only; use norm_type=2 or optimizer='keep'")
            optimizer.max_grad_norm = float(max_norm)
            if self.scaler is not None and self.native_amp:
                self.unscale_gradients()
                if state.engine is not None:
                    state.engine.scale_grad_sq_norms(self.scaler.get_scale() ** -2)
            installed_step(optimizer).set_norms(optimizer)  # the step then keeps them
            return optimizer.grad_norm()
        if state is not None and state.store is not None:  # each rank: its share's grads
            return clip_shares(parameters, max_norm, norm_type, state.reducer)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def wait_for_everyone(self) -> None:
        """Stock barrier; with LazyTrain it also waits for a running layer-wise update, so
        parameters read right after it (the usual end of a loop) are the updated ones."""
        self._lazytrain_synchronize()
        super().wait_for_everyone()

    def wait_for_update(self) -> None:
        """Block until the optimizer update that `optimizer.step()` left running is whole.
        The next forward, the model's `parameters()` and `state_dict()`, `unwrap_model`
        and `wait_for_everyone` wait themselves; other reads of the masters or of
        `optimizer.state` right after the step must call this first, or they read some
        layers updated and others not."""
        self._lazytrain_synchronize()

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """Stock `unwrap_model`; with LazyTrain it first waits for a running update, so
        the parameters of the model it returns are the updated ones."""
        self._lazytrain_synchronize()
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """Stock `get_state_dict`, once a running update is whole; under the split layout
        below fp32 compute, where a node holds the layers other nodes update as their
        compute copy alone, the fp32 masters of those are gathered from the nodes that
        hold them (`NodeExchange.gather_masters`), and the masters a node store's ranks
        home on NVMe from the rank that updates each (`HomedMasters.gather`). Then, as with
        ZeRO-3 or FSDP, every rank calls it (as `save_model` does)."""
        from lazytrain_accel.distributed.node_exchange import NodeExchange

        self._lazytrain_synchronize()
        if not self.lazytrain_gathers_weights():
            return super().get_state_dict(model, unwrap=unwrap)
        engine, homed = self.lazytrain.engine, self.lazytrain.homed
        remote = engine.steps.remote
        gathered = {}
        if isinstance(remote, NodeExchange):
            gathered |= remote.gather_masters(engine.steps.update_groups)
        if homed is not None:
            gathered |= homed.gather(engine.steps.update_groups)
        module = self.unwrap_model(model) if unwrap else model
        # the parameters themselves (a plain state_dict() refuses the placeholders)
        return {name: gathered.get(value, value).detach()
                for name, value in module.state_dict(keep_vars=True).items()}

    def lazytrain_gathers_weights(self) -> bool:
        """Whether no process holds every weight (the split layout below fp32 compute;
        masters homed on NVMe by a node store's ranks), so that a full state dict is
        gathered (`get_state_dict`)."""
        from lazytrain_accel.distributed.node_exchange import NodeExchange

        engine = self.lazytrain.engine if self.lazytrain is not None else None
        if engine is None:
            return False
        remote = engine.steps.remote
        return (isinstance(remote, NodeExchange) and remote.sends_copies) \
            or self.lazytrain.homed is not None

    # ---- state ----------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **kwargs: Any) -> str:
        """Stock `save_state` plus the plan. With LazyTrain the streamed model and its
        optimizer go to a share checkpoint (`frontends/share_checkpoint.py`): the
        weights in the layout `from_pretrained` expects, the optimizer state per share,
        atomic. A layer-wise update still running is waited for: the checkpoint holds
        its result."""
        self.lazytrain_settle_before_save()
        if self.lazytrain is not None:
            return self._lazytrain_save_shares(output_dir, safe_serialization, kwargs)
        if self.lazytrain_plugin is None or output_dir is None or self.num_processes > 1:
            location = super().save_state(output_dir, safe_serialization=safe_serialization,
                                          **kwargs)
            self._lazytrain_save_plan(Path(location))
            return location
        with atomic_directory(output_dir) as tmp:
            super().save_state(str(tmp), safe_serialization=safe_serialization, **kwargs)
            self._lazytrain_save_plan(tmp)
        return str(output_dir)

    def _lazytrain_save_shares(self, output_dir: str | None, safe_serialization: bool,
                               kwargs: dict[str, Any]) -> str:
        """A share checkpoint (`frontends/share_checkpoint.py`): rank 0 writes the
        weights once, every rank its share of the optimizer state (without a node store:
        rank 0 the whole), rank 0 the manifest last; atomic. With the layer-wise update
        and `checkpoint_mode="async"`: written beside the next steps, each rank its own
        part (`checkpoints/asynchronous.py`); this returns once it has started."""
        final = share_checkpoint.target_directory(self, output_dir)

        def write_stock(directory: Path) -> None:  # schedulers, samplers, RNG, the plan
            with share_checkpoint.hidden(self, self.lazytrain.model, self.lazytrain.optimizer):
                super(Accelerator, self).save_state(
                    str(directory), safe_serialization=safe_serialization, **kwargs)
            self._lazytrain_save_plan(directory)

        if self.lazytrain_saves_with_writer():
            self.lazytrain_start_save(final, write_stock,
                                      on_published=lambda: share_checkpoint.rotate(self, final))
            if not self.lazytrain_saves_async():
                self.lazytrain_wait_for_checkpoint()
            return str(final)
        start_s = time.perf_counter()
        share_checkpoint.save_shares(self, final, write_stock)
        share_checkpoint.rotate(self, final)
        logger.info("lazytrain: checkpoint %s written (sync, %.2f s)", final,
                    time.perf_counter() - start_s)
        return str(final)

    def lazytrain_saves_with_writer(self) -> bool:
        """Whether a save goes through the checkpoint writer (`lazytrain_start_save`):
        beside training (`lazytrain_saves_async`), or, where the plan homes masters and
        moments on NVMe, waited for (it copies them from their files, which a stock save
        would read back into DRAM whole)."""
        engine = self.lazytrain.engine
        return self.lazytrain_saves_async() or (engine is not None
                                                and bool(engine.masters.layers))

    def lazytrain_saves_async(self) -> bool:
        """The setting, and an update that runs layer by layer (the per-group wait the save
        hooks into), on every rank alike: on its thread, or, where the plan homes masters
        and moments on NVMe, at the step (read back group by group, each past its gate)."""
        state = self.lazytrain
        if self.lazytrain_plugin.checkpoint_mode != "async" or state.engine is None:
            return False
        step = installed_step(state.optimizer)
        return bool(state.engine.masters.layers) or (step is not None and step.overlapped)

    def lazytrain_start_save(self, final: Path, write_stock: Callable[[Path], None], *,
                             on_published: Callable[[], None]) -> None:
        """Start the asynchronous save of `final` (`checkpoints/asynchronous.py`), on every
        rank at the same point, after the step's update and any earlier save: the small
        files now (`write_stock(tmp)`: what belongs to this step), the masters and the
        optimizer state by the writer thread, the next update of each group waiting at its
        gate; `on_published` runs (rank 0, on the writer thread) once it is in place.
        `save_state` and the Trainer's checkpoint both start their saves here."""
        start_s = time.perf_counter()
        self.lazytrain.pending_save = async_checkpoint.start_save(
            self, final, write_stock, on_published=on_published)
        self.lazytrain.engine.steps.save_gate = self.lazytrain.pending_save
        logger.info("lazytrain: checkpoint %s started (async; returned after %.2f s)",
                    final, time.perf_counter() - start_s)

    def lazytrain_wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written beside training is published; raise if
        its save failed (the previous checkpoint is kept)."""
        state = self.lazytrain
        if state is None or state.pending_save is None:
            return
        pending, state.pending_save = state.pending_save, None
        try:
            pending.wait()
        finally:
            if state.engine is not None:
                state.engine.steps.save_gate = None

    def lazytrain_settle_before_save(self) -> None:
        """What every save (`save_state`, the Trainer's checkpoint) waits for first: a
        pending save, published (a second save waits for the first), then the running
        layer-wise update, whole (the checkpoint holds the step's result)."""
        self.lazytrain_wait_for_checkpoint()
        self._lazytrain_synchronize()

    def _lazytrain_save_plan(self, directory: Path) -> None:
        if self.lazytrain is not None and self.is_main_process:
            self.lazytrain.run.plan.save(directory / PLAN_FILE)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        self.lazytrain_wait_for_checkpoint()  # no save may read what the load writes
        if self.lazytrain_plugin is not None:
            input_dir = self._lazytrain_recover(input_dir)
        self._lazytrain_synchronize()  # no update may write the masters being loaded
        state = self.lazytrain
        manifest = (read_manifest(Path(input_dir))
                    if state is not None and input_dir is not None else None)
        if manifest is not None or (state is not None and state.store is not None
                                    and input_dir is not None):
            # The streamed model's weights and optimizer come from the shares, the rest
            # (schedulers, samplers, RNG) from accelerate.
            share_checkpoint.load_shares(self, Path(input_dir), manifest)
            with share_checkpoint.hidden(self, state.model, state.optimizer):
                super().load_state(input_dir, **kwargs)
        else:
            super().load_state(input_dir, **kwargs)
        if state is None or input_dir is None:
            return
        from lazytrain_accel.planning import Plan

        saved = Path(input_dir) / PLAN_FILE
        if saved.is_file():
            previous = Plan.load(saved)
            self.lazytrain_adopt_shape(previous)
            previous.check_fingerprint(state.run.plan.fingerprint)

    def _lazytrain_recover(self, input_dir: str | None) -> str | None:
        """Undo what killed saves left (the main process; the others wait for it) and name
        the folder to load: `input_dir`, or with automatic naming the latest published
        checkpoint (`latest_directory`), never a killed save's temporary directory."""
        latest = input_dir is None and self.project_configuration.automatic_checkpoint_naming
        if input_dir is None and not latest:
            return None  # stock load_state names what is missing
        if self.is_main_process:
            if latest:
                recover_all(Path(self.project_dir) / "checkpoints")
            else:
                recover(input_dir)  # a save killed between its renames left the old one
        if self.num_processes > 1:
            super().wait_for_everyone()
        return str(share_checkpoint.latest_directory(self)) if latest else input_dir

    def lazytrain_adopt_shape(self, previous: Plan) -> None:
        """A checkpoint's plan sized for longer batches than this run's (it re-planned
        upward before it was saved): plan for that shape too, so resuming matches it."""
        self.lazytrain.adopt_shape(previous)

    def end_training(self) -> None:
        self.lazytrain_wait_for_checkpoint()  # published whole before the run ends
        if self.lazytrain is not None:
            self.lazytrain.end()
        super().end_training()


def _refuse_foreign_plugins(kwargs: dict[str, Any]) -> None:
    given = [name for name in _FOREIGN_PLUGINS if kwargs.get(name) is not None]
    given += [name for name in _FOREIGN_ENV
              if os.environ.get(name, "false").lower() in ("true", "1")]
    if given:
        raise ValueError(
            f"LazyTrainPlugin cannot be combined with {', '.join(given)}: LazyTrain already "
            "streams the model and owns the optimizer. Remove the other plugin (or the "
            "DeepSpeed/FSDP/Megatron setting of your `accelerate config`), or drop plugin=."
        )


def _wrap_forward_in_autocast(model: nn.Module) -> None:
    """Run `model.forward` under the Accelerator's autocast, as stock `prepare_model` does
    (a fresh context manager per call: autocast contexts are not reentrant objects)."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    original = model.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with get_mixed_precision_context_manager(True, None):
            return original(*args, **kwargs)

    model._original_forward = original
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)
