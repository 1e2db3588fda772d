"""`Accelerator(..., plugin=LazyTrainPlugin(...))`: a drop-in subclass of accelerate's.

Stock `accelerate.Accelerator` rejects unknown keywords and its kwargs-handler table is
closed, so LazyTrain ships a subclass. Without `plugin=` it is the stock Accelerator.
With it, `prepare` profiles, plans, attaches the streaming engine and swaps the optimizer;
the model is never moved to the device whole and never wrapped in DDP.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import accelerate
import torch
from torch import nn

from lazytrain_accel import preflight, threads
from lazytrain_accel.checkpoints import asynchronous as async_checkpoint
from lazytrain_accel.checkpoints import shares as share_checkpoint
from lazytrain_accel.checkpoints.atomic import atomic_directory, recover
from lazytrain_accel.config import ANONYMOUS_SEGMENT, LazyTrainConfig
from lazytrain_accel.distributed import generation_words, node_store, ranks, split_update
from lazytrain_accel.distributed.data_parallel import GradientAllReducer
from lazytrain_accel.run import batch_shape, setup
from lazytrain_accel.run.replanner import Replanner, replanner_for
from lazytrain_accel.run.step import OptimizerStep, installed_step
from lazytrain_accel.run.step_guard import StepGuard

if TYPE_CHECKING:
    from lazytrain_accel.engine import StreamingEngine

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
        self.lazytrain_run: setup.PreparedRun | None = None
        self.lazytrain_engine: StreamingEngine | None = None
        self.lazytrain_guard: StepGuard | None = None
        self._lazytrain_pending_save: async_checkpoint.PendingSave | None = None
        #: fits the profile to measured rates and switches plans (replan="auto")
        self.lazytrain_replanner: Replanner | None = None
        self._lazytrain_optimizer: torch.optim.Optimizer | None = None
        self._lazytrain_reducer: GradientAllReducer | split_update.ShareReducer | None = None
        #: one host copy per node, mapped by every local rank (None: each rank its own)
        self.lazytrain_store: node_store.NodeStore | None = None
        #: the local ranks planned as one node sharing that copy (1: this rank alone)
        self.lazytrain_node_ranks = 1
        #: the node_store_dir that cannot hold the store (each rank its own copy instead)
        self._lazytrain_segment_room: preflight.SegmentRoom | None = None
        #: the nodes of the launch, each with its own copy (`lazytrain_node_ranks` ranks)
        self.lazytrain_nodes = 1
        self._lazytrain_model: nn.Module | None = None
        #: the shape the plan is sized for (provisional until the first batch without a loader)
        self.lazytrain_sizing: batch_shape.Sizing | None = None
        #: a sequence bound the front end knows (the Trainer sets TRL's max_length).
        self.lazytrain_seq_bound: int | None = None

    # ---- prepare --------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.lazytrain_plugin is None:
            return super().prepare(*args, device_placement=device_placement)
        models = [a for a in args if isinstance(a, nn.Module)]
        if len(models) > 1 or (models and self._lazytrain_model not in (None, models[0])):
            raise ValueError("LazyTrain streams exactly one model per Accelerator; prepare "
                             "other models with a stock accelerate.Accelerator.")
        if models and self._lazytrain_model is None:  # a second prepare() of it is a no-op
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
        if self.lazytrain_plugin is not None and model is self._lazytrain_model:
            return model  # streamed already: never move it to the device whole
        return super().prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=evaluation_mode)

    def _lazytrain_prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        if self._lazytrain_model is None:
            raise ValueError("prepare the model before (or together with) its optimizer: "
                             "LazyTrain rebuilds the optimizer on the streamed model's host "
                             "masters")
        if isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
            if optimizer.optimizer is self._lazytrain_optimizer:
                return optimizer  # already ours and prepared
            optimizer = optimizer.optimizer
        self._lazytrain_optimizer = setup.build_optimizer(self.lazytrain_plugin, optimizer,
                                                          self._lazytrain_model)
        # before accelerate's prepare: with a loss scaler it keeps `optimizer.step`
        step = self._lazytrain_overlap(self._lazytrain_optimizer)
        prepared = super().prepare_optimizer(self._lazytrain_optimizer, device_placement=False)
        step.on_boundary = lambda skipped: self._lazytrain_stepped(prepared, skipped)
        return prepared

    def _lazytrain_stepped(self, prepared: Any, skipped: bool) -> None:
        """A step boundary: tell accelerate whether the step was skipped (its schedulers
        and the Trainer consult `step_was_skipped`); the re-planner may switch plans."""
        prepared._is_overflow = skipped
        if self.lazytrain_replanner is not None:
            self.lazytrain_replanner.on_step()

    def _lazytrain_overlap(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """`optimizer.step()` becomes the run's `OptimizerStep` (`run/step.py`): with the
        hybrid operator (and `overlap_step`) it starts the engine's layer-wise update on
        its thread and returns; reading or loading the optimizer's state first waits for
        that update to end."""
        from lazytrain_accel.optim import HybridAdamW8bit

        optimizer.register_state_dict_pre_hook(lambda _: self._lazytrain_synchronize())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self._lazytrain_synchronize())
        if isinstance(optimizer, HybridAdamW8bit) and self.lazytrain_store is not None:
            optimizer.gather_grad_norms = self._lazytrain_reducer.grad_norm_tables
        # optimizer="keep" (any torch optimizer) steps serially, inline
        step = OptimizerStep(guard=self.lazytrain_guard, engine=self.lazytrain_engine,
                             overlapped=isinstance(optimizer, HybridAdamW8bit)
                             and self.lazytrain_plugin.overlap_step)
        step.install(optimizer)
        return step

    def _lazytrain_synchronize(self) -> None:
        if self.lazytrain_engine is not None:
            self.lazytrain_engine.synchronize()

    def _lazytrain_prepare_model(self, model: nn.Module, loader: Any) -> None:
        from lazytrain_accel.engine import attach
        from lazytrain_accel.profiling.hardware_spec import load_hardware

        plugin = self.lazytrain_plugin
        if self.num_processes > 1 and plugin.bind_cores == "auto" and plugin.threads == 0:
            ranks.bind_local_cores(local_rank=self.local_process_index,
                                   node_id=node_store.launch_identity(os.environ)[1])
        threads.apply_threads(plugin.threads, device=self.device)  # before any timing
        # config.use_cache stays as the user set it: the engine strips KV caches from
        # training calls itself, and the config is what save_pretrained writes.
        compute_dtype = setup.compute_dtype_for(self.mixed_precision)
        if plugin.frozen_weights != "keep":  # before profiling: plan the packed base
            from lazytrain_accel.engine.memory.quantize_base import quantize_frozen_linears

            quantize_frozen_linears(model, plugin.frozen_weights, compute_dtype or torch.float32)
        self.lazytrain_sizing = batch_shape.size_run(loader, model, plugin,
                                                      seq_bound=self.lazytrain_seq_bound)
        hardware = setup.hardware_for_backend(plugin, load_hardware(
            plugin.hardware, cache_dir=plugin.cache_dir, nvme_dir=plugin.nvme_dir))
        self.lazytrain_node_ranks = self._lazytrain_node_ranks(model)  # planned as one node
        self.lazytrain_run = self._lazytrain_plan_for(model, self.lazytrain_sizing, hardware)
        plan, model_profile = self.lazytrain_run.plan, self.lazytrain_run.model_profile
        if self.num_processes > 1:  # one model and one plan on every rank, a clean exit
            ranks.check_ranks_agree(plan, model)
            ranks.register_exit_teardown(self._lazytrain_synchronize)
        # Before the engine allocates anything: fail with a sentence, not an OOM kill. A
        # node's ranks check the node's bytes against the same (their least) free figure.
        available = preflight.available_host_bytes()
        estimate = preflight.check_run(
            model=model, plan=plan, model_profile=model_profile,
            optimizer=plugin.optimizer.value, nvme_dir=plugin.nvme_dir,
            available_bytes=available if self.lazytrain_node_ranks == 1
            else ranks.least(available))
        if self._lazytrain_segment_room is not None:  # a copy per rank, if they all fit
            warning = preflight.check_per_rank_copies(
                self._lazytrain_segment_room, estimate, available_bytes=ranks.least(available),
                copies=int(os.environ["LOCAL_WORLD_SIZE"]))
            if self.is_main_process:
                logger.warning("lazytrain: %s", warning)
        self.lazytrain_store = self._lazytrain_share(model, plan.num_layers + 2)
        self.lazytrain_engine = attach(model, plan, device=self.device,
                                       compute_dtype=compute_dtype, nvme_dir=plugin.nvme_dir,
                                       loss_chunk_tokens=setup.engine_loss_chunk_tokens(plugin),
                                       emulation=setup.emulation_for(plugin, hardware))
        if not setup.is_plan_file(plugin):  # a plan file is the user's: never re-planned
            self.lazytrain_engine.replan = lambda b, s: self._lazytrain_replan(model, b, s)
            if plugin.replan == "auto" and self.num_processes == 1:
                self.lazytrain_replanner = replanner_for(
                    plugin, engine=self.lazytrain_engine, run=self.lazytrain_run,
                    adopt=lambda run: setattr(self, "lazytrain_run", run), device=self.device)
        self.lazytrain_guard = StepGuard(model=model, engine=self.lazytrain_engine,
                                         max_nonfinite_skips=plugin.max_nonfinite_skips,
                                         raise_on_interrupt=self._lazytrain_interrupt_raises)
        self.lazytrain_guard.install_sigint()
        if self.lazytrain_store is not None:
            _, node_id = node_store.launch_identity(os.environ)
            layout = split_update.node_groups(local_rank=self.local_process_index,
                                              local_world_size=self.lazytrain_node_ranks,
                                              node_id=node_id)
            self._lazytrain_reducer = split_update.start_split_update(
                self.lazytrain_engine, generations=self.lazytrain_store.generations,
                layout=layout,
                should_reduce=lambda: self.sync_gradients)
            self._lazytrain_pin_store(model)
            self.lazytrain_guard.global_finite = self._lazytrain_global_finite
        elif self.num_processes > 1:
            self._lazytrain_reducer = GradientAllReducer(
                self.lazytrain_engine, model, should_reduce=lambda: self.sync_gradients)
        if self.native_amp:
            _wrap_forward_in_autocast(model)
        model._is_accelerate_prepared = True
        self._lazytrain_model = model
        self._models.append(model)

    def _lazytrain_node_ranks(self, model: nn.Module) -> int:
        """The local ranks that will share one host copy (the node store): a node's
        processes (LOCAL_WORLD_SIZE) with `node_store="auto"`, each node its own copy
        (`lazytrain_nodes` of them), else 1 (each rank its own copy; also when the
        `node_store_dir` cannot hold it, `_lazytrain_segment_room`)."""
        if self.num_processes == 1:
            return 1
        plugin = self.lazytrain_plugin
        why_not = node_store.unusable_because(plugin.node_store, num_processes=self.num_processes,
                                              env=os.environ, store_dir=plugin.node_store_dir)
        report = logger.info
        if why_not is None and (unsafe := generation_words.unavailable_because()):
            why_not, report = f"the node store is refused: {unsafe}", logger.warning
        if why_not is None and plugin.node_store_dir != ANONYMOUS_SEGMENT:
            room = node_store.room_for(model, plugin.node_store_dir)
            room = dataclasses.replace(room, free_bytes=ranks.least(room.free_bytes))
            if not room.fits:  # every rank sees the same figure: they fall back together
                self._lazytrain_segment_room = room
                why_not = f"{room.directory} cannot hold the node store"
        if why_not is None:
            local = int(os.environ["LOCAL_WORLD_SIZE"])
            self.lazytrain_nodes = self.num_processes // local
            return local
        if self.is_main_process:
            report("lazytrain: each rank keeps its own host copy and the whole update "
                   "(gradients all-reduced): %s", why_not)
        return 1

    def _lazytrain_share(self, model: nn.Module, num_groups: int
                         ) -> node_store.NodeStore | None:
        """Map the parameters from the node's shared segment (`_lazytrain_node_ranks`),
        else None: every rank keeps its own copy (all-reduce)."""
        if self.lazytrain_node_ranks == 1:
            return None
        directory = self.lazytrain_plugin.node_store_dir
        if self.is_main_process:
            logger.info("lazytrain: %s", node_store.room_for(model, directory).describe())
        job_id, node_id = node_store.launch_identity(os.environ)
        return node_store.share_model(
            model, name=node_store.segment_name(job_id=job_id, node_id=node_id),
            leader=self.local_process_index == 0, local_ranks=self.lazytrain_node_ranks,
            num_groups=num_groups, barrier=torch.distributed.barrier,
            directory=None if directory == ANONYMOUS_SEGMENT else Path(directory))

    def _lazytrain_pin_store(self, model: nn.Module) -> None:
        """Page-lock the node store for the device's copies, in chunks; where any local
        rank could not (warned there), every rank re-plans on the pageable copy rates, so
        the ranks keep one plan (`ranks.check_ranks_agree`)."""
        max_chunk_bytes = int(self.lazytrain_plugin.pin_chunk_max_gib * 1024**3)
        pinned = self.lazytrain_engine.streams.register_pinned(
            self.lazytrain_store.bytes, max_chunk_bytes=max_chunk_bytes)
        if ranks.least(int(pinned)):
            return
        run = self._lazytrain_plan_for(model, self.lazytrain_sizing,
                                       self.lazytrain_run.hardware.pageable_links(),
                                       replan=True)
        self.lazytrain_engine.set_plan(run.plan)
        self._lazytrain_adopt(run, self.lazytrain_sizing)

    def _lazytrain_global_finite(self) -> bool:
        return math.isfinite(self._lazytrain_reducer.global_grad_sq_norm())

    def _lazytrain_plan_for(self, model: nn.Module, sizing: batch_shape.Sizing,
                            hardware: Any, *, replan: bool = False) -> setup.PreparedRun:
        """Profile and plan for `sizing`; summarize the plan unless it is provisional. A
        `replan` keeps the attached engine's residents where they are (`resident_update`)."""
        plugin = self.lazytrain_plugin
        model_profile = setup.profile_for_run(
            model, batch_size=sizing.batch_size, seq_len=sizing.seq_len,
            compute_dtype=setup.compute_dtype_for(self.mixed_precision),
            loss_chunk_tokens=plugin.loss_chunk_tokens)
        plan = setup.resolve_plan(plugin, model_profile, hardware, resident_update=(
            self.lazytrain_engine.plan.resident_update if replan else None),
            gpus_per_node=self.lazytrain_node_ranks, nodes=self.lazytrain_nodes)
        if self.is_main_process and not sizing.provisional:
            logger.info("%s (sized from %s)", setup.format_plan_summary(plan), sizing.source)
        return setup.PreparedRun(model_profile=model_profile, hardware=hardware, plan=plan)

    def _lazytrain_replan(self, model: nn.Module, batch_size: int, seq_len: int) -> Any:
        """The engine saw a (batch, seq) batch beyond its plan: plan once upward (cached)."""
        from lazytrain_accel.planning import PlanInfeasibleError

        sizing = batch_shape.grown(self.lazytrain_sizing, batch_size, seq_len)
        try:
            run = self._lazytrain_plan_for(model, sizing, self.lazytrain_run.hardware,
                                           replan=True)
        except PlanInfeasibleError as err:
            logger.warning("lazytrain: a batch of %d x %d tokens needs a new plan, and none "
                           "fits: %s", batch_size, seq_len, err)
            return None
        # the larger plan may home more on NVMe: fail with a sentence, not an ENOSPC
        preflight.check_nvme_dir(self.lazytrain_plugin.nvme_dir,
                                 preflight.nvme_need_bytes(run.plan))
        self._lazytrain_adopt(run, sizing)
        return run.plan

    def _lazytrain_adopt(self, run: setup.PreparedRun, sizing: batch_shape.Sizing) -> None:
        """`run`, planned for `sizing`, becomes this run's: the re-planner solves and
        prices with its model profile from the next step on."""
        self.lazytrain_sizing, self.lazytrain_run = sizing, run
        if self.lazytrain_replanner is not None:
            self.lazytrain_replanner.run = run

    # ---- the training step ----------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)
        if self._lazytrain_reducer is not None and self.sync_gradients:
            self._lazytrain_reducer.finish()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Global gradient norm; with the hybrid operator, clipping happens inside its
        fused update (the gradients are not touched here, so nothing is clipped twice).
        fp16 loss scaling is undone first, as stock does, and the norms the engine
        recorded as the scaled gradients landed are rescaled with it."""
        from lazytrain_accel.optim import HybridAdamW8bit

        optimizer = self._lazytrain_optimizer
        if isinstance(optimizer, HybridAdamW8bit):
            if norm_type != 2:
                raise ValueError(f"norm_type={norm_type}: the hybrid 8-bit operator clips by "
                                 "the L2 norm only; use norm_type=2 or optimizer='keep'")
            optimizer.max_grad_norm = float(max_norm)
            if self.scaler is not None and self.native_amp:
                self.unscale_gradients()
                if self.lazytrain_engine is not None:
                    self.lazytrain_engine.scale_grad_sq_norms(self.scaler.get_scale() ** -2)
            if self.lazytrain_engine is not None:
                optimizer.set_grad_sq_norms(self.lazytrain_engine.grad_sq_norms())
            return optimizer.grad_norm()
        if self.lazytrain_store is not None:  # each rank holds its share's gradients
            return split_update.clip_shares(parameters, max_norm, norm_type,
                                            self._lazytrain_reducer)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def wait_for_everyone(self) -> None:
        """Stock barrier; with LazyTrain it also waits for a running layer-wise update, so
        parameters read right after it (the usual end of a loop) are the updated ones."""
        self._lazytrain_synchronize()
        super().wait_for_everyone()

    # ---- state ----------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **kwargs: Any) -> str:
        """Stock `save_state` plus the plan. With LazyTrain the streamed model and its
        optimizer go to a share checkpoint (`checkpoints/shares.py`): the
        weights in the layout `from_pretrained` expects, the optimizer state per share,
        atomic. A layer-wise update still running is waited for: the checkpoint holds
        its result."""
        self.lazytrain_wait_for_checkpoint()  # a second save waits for the first
        self._lazytrain_synchronize()
        if self.lazytrain_plugin is not None and self._lazytrain_model is not None:
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
        """A share checkpoint (`checkpoints/shares.py`): rank 0 writes the
        weights once, every rank its share of the optimizer state (without a node store:
        rank 0 the whole), rank 0 the manifest last; atomic. One process with the
        layer-wise update and `checkpoint_mode="async"`: written beside the next steps
        (`checkpoints/asynchronous.py`); this returns once it has started."""
        final = share_checkpoint.target_directory(self, output_dir)

        def write_stock(directory: Path) -> None:  # schedulers, samplers, RNG, the plan
            with share_checkpoint.hidden(self, self._lazytrain_model,
                                         self._lazytrain_optimizer):
                super(Accelerator, self).save_state(
                    str(directory), safe_serialization=safe_serialization, **kwargs)
            self._lazytrain_save_plan(directory)

        start_s = time.perf_counter()
        if self._lazytrain_saves_async():
            self._lazytrain_pending_save = async_checkpoint.start_save(
                self, final, write_stock,
                on_published=lambda: share_checkpoint.rotate(self, final))
            self.lazytrain_engine.steps.save_gate = self._lazytrain_pending_save
            logger.info("lazytrain: checkpoint %s started (async; returned after %.2f s)",
                        final, time.perf_counter() - start_s)
            return str(final)
        share_checkpoint.save_shares(self, final, write_stock)
        share_checkpoint.rotate(self, final)
        logger.info("lazytrain: checkpoint %s written (sync, %.2f s)", final,
                    time.perf_counter() - start_s)
        return str(final)

    def _lazytrain_saves_async(self) -> bool:
        """One process whose update runs layer by layer on its thread (the per-group wait
        the save hooks into), and the setting."""
        return (self.lazytrain_plugin.checkpoint_mode == "async" and self.num_processes == 1
                and self.lazytrain_engine is not None
                and (step := installed_step(self._lazytrain_optimizer)) is not None
                and step.overlapped)

    def lazytrain_wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written beside training is published; raise if
        its save failed (the previous checkpoint is kept)."""
        pending, self._lazytrain_pending_save = self._lazytrain_pending_save, None
        if pending is None:
            return
        try:
            pending.wait()
        finally:
            if self.lazytrain_engine is not None:
                self.lazytrain_engine.steps.save_gate = None

    def _lazytrain_save_plan(self, directory: Path) -> None:
        if self.lazytrain_run is not None and self.is_main_process:
            self.lazytrain_run.plan.save(directory / PLAN_FILE)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        self.lazytrain_wait_for_checkpoint()  # no save may read what the load writes
        if self.lazytrain_plugin is not None and input_dir is not None:
            if self.is_main_process:  # one rank repairs; the others wait for it
                recover(input_dir)  # a save killed between its renames left the old one
            if self.num_processes > 1:
                super().wait_for_everyone()
        self._lazytrain_synchronize()  # no update may write the masters being loaded
        manifest = (share_checkpoint.read_manifest(Path(input_dir))
                    if self._lazytrain_model is not None and input_dir is not None else None)
        if manifest is not None or (self.lazytrain_store is not None and input_dir is not None):
            # The streamed model's weights and optimizer come from the shares, the rest
            # (schedulers, samplers, RNG) from accelerate.
            share_checkpoint.load_shares(self, Path(input_dir), manifest)
            with share_checkpoint.hidden(self, self._lazytrain_model, self._lazytrain_optimizer):
                super().load_state(input_dir, **kwargs)
        else:
            super().load_state(input_dir, **kwargs)
        if self.lazytrain_run is None or input_dir is None:
            return
        from lazytrain_accel.planning import Plan

        saved = Path(input_dir) / PLAN_FILE
        if saved.is_file():
            previous = Plan.load(saved)
            self.lazytrain_adopt_shape(previous)
            previous.check_fingerprint(self.lazytrain_run.plan.fingerprint)

    def lazytrain_adopt_shape(self, previous: Any) -> None:
        """A checkpoint's plan sized for longer batches than this run's (it re-planned
        upward before it was saved): plan for that shape too, so resuming matches it."""
        plan = self.lazytrain_run.plan
        tokens = previous.batch_size * previous.seq_len
        if (self.lazytrain_engine is None or self.lazytrain_engine.replan is None
                or tokens <= plan.batch_size * plan.seq_len):
            return
        sizing = batch_shape.Sizing(batch_size=previous.batch_size, seq_len=previous.seq_len,
                                    source="the checkpoint's plan",
                                    seq_cap=self.lazytrain_sizing.seq_cap)
        run = self._lazytrain_plan_for(self._lazytrain_model, sizing,
                                       self.lazytrain_run.hardware, replan=True)
        self._lazytrain_adopt(run, sizing)
        self.lazytrain_engine.set_plan(run.plan)

    def end_training(self) -> None:
        self.lazytrain_wait_for_checkpoint()  # published whole before the run ends
        if self.lazytrain_guard is not None:
            self.lazytrain_guard.restore_sigint()
        if self.lazytrain_replanner is not None:
            self.lazytrain_replanner.close()
            self.lazytrain_replanner = None
        if self.lazytrain_engine is not None:
            self.lazytrain_engine.detach()  # waits for a running update first
            self.lazytrain_engine = None
        if (step := installed_step(self._lazytrain_optimizer)) is not None:
            step.engine = None  # no engine left: step inline
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
