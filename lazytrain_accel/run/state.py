"""`RunState`: one streamed run's state, built once by `build_run_state`.

The plan, the shape it is sized for, the engine, the optimizer wiring, the step guard,
the re-planner, the node store and the gradient reducer live here, and the current plan
lives here only: `RunState.adopt` is the one place a new plan takes over (the engine's
copy is set from it, the re-planner reads it from here). The Accelerator and the
Trainer's Accelerator hold it as one attribute, `accelerator.lazytrain`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lazytrain_accel import preflight, threads
from lazytrain_accel.config import LazyTrainConfig
from lazytrain_accel.distributed import node_exchange, node_store, ranks, split_update
from lazytrain_accel.distributed.data_parallel import GradientAllReducer
from lazytrain_accel.distributed.grad_reduce import ShareReducer
from lazytrain_accel.distributed.homed_masters import HomedMasters
from lazytrain_accel.distributed.ownership import node_groups
from lazytrain_accel.engine.memory.weights import NodeCopies
from lazytrain_accel.run import batch_shape, setup, shared
from lazytrain_accel.run.node_layout import NodeLayout, node_layout_for, share_store
from lazytrain_accel.run.replan_ranks import LaunchReplanner, LaunchTotals
from lazytrain_accel.run.replanner import Replanner, replanner_for
from lazytrain_accel.run.step import installed_step
from lazytrain_accel.run.step_guard import StepGuard

if TYPE_CHECKING:
    from lazytrain_accel.checkpoints.asynchronous import PendingSave
    from lazytrain_accel.engine import StreamingEngine
    from lazytrain_accel.planning import Budgets, Plan
    from lazytrain_accel.profiling.hardware import HardwareProfile

logger = logging.getLogger("lazytrain_accel")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """What the front end knows of the launch, as `build_run_state` needs it."""

    num_processes: int
    local_process_index: int
    is_main_process: bool
    device: torch.device
    mixed_precision: str | None
    #: Ctrl-C raises `TrainingInterrupted` at the step boundary (a Trainer stops instead)
    interrupt_raises: bool
    #: a sequence bound the front end knows (the Trainer passes TRL's max_length)
    seq_bound: int | None
    #: whether this backward ends an accumulation (`Accelerator.sync_gradients`)
    should_reduce: Callable[[], bool]
    #: waits for a running update (a bound method: registered weakly for the exit)
    synchronize: Callable[[], None]


@dataclasses.dataclass(kw_only=True, eq=False)
class RunState:
    plugin: LazyTrainConfig
    launch: Launch
    model: nn.Module
    #: the shape the plan is sized for (provisional until the first batch without a loader)
    sizing: batch_shape.Sizing
    #: the current plan with the profiles it was made from: set by `adopt` only
    run: setup.PreparedRun
    layout: NodeLayout
    #: what every rank plans within: per tier, the least of the ranks' (`run/shared.py`)
    budgets: Budgets
    #: None once `end` detached it
    engine: StreamingEngine | None
    guard: StepGuard
    #: fits the profile to measured rates and switches plans (replan="auto")
    replanner: Replanner | LaunchReplanner | None = None
    #: one host copy per node, mapped by every local rank (None: each rank its own)
    store: node_store.NodeStore | None = None
    reducer: GradientAllReducer | ShareReducer | None = None
    #: the masters the node's ranks home on NVMe, gathered for a full state dict
    homed: HomedMasters | None = None
    #: the optimizer rebuilt on the streamed model's host masters (set at its prepare)
    optimizer: torch.optim.Optimizer | None = None
    #: a checkpoint being written beside training (`checkpoint_mode="async"`)
    pending_save: PendingSave | None = None

    def masters_in_dram(self) -> contextlib.AbstractContextManager[None]:
        """Within: the masters and moments the plan homes on NVMe are in DRAM, in their
        own tensors (`StreamingEngine.masters_in_dram`), for a checkpoint's save or load."""
        if self.engine is None:
            return contextlib.nullcontext()
        return self.engine.masters_in_dram(self.optimizer)

    def plan_for(self, sizing: batch_shape.Sizing, hardware: HardwareProfile) -> setup.PreparedRun:
        """A re-plan for `sizing` on `hardware`, the residents where the engine keeps them."""
        return plan_for(self.plugin, self.model, sizing, hardware, launch=self.launch,
                        layout=self.layout, budgets=self.budgets,
                        resident_update=self.run.plan.resident_update)

    def adopt(self, run: setup.PreparedRun, sizing: batch_shape.Sizing | None = None) -> None:
        """`run` (planned for `sizing`, default the current shape) becomes the run's: the
        engine runs its plan from the next forward, the re-planner solves and prices with
        its model profile from the next step on."""
        if self.engine is not None and self.engine.plan is not run.plan:
            self.engine.set_plan(run.plan)  # refuses a plan it cannot run: nothing changed
        self.run, self.sizing = run, sizing or self.sizing

    def replan(self, batch_size: int, seq_len: int) -> Plan | None:
        """The engine saw a (batch, seq) batch beyond its plan: plan once upward (cached)."""
        from lazytrain_accel.planning import PlanInfeasibleError

        sizing = batch_shape.grown(self.sizing, batch_size, seq_len)
        try:
            run = self.plan_for(sizing, self.run.hardware)
        except PlanInfeasibleError as err:
            logger.warning("lazytrain: a batch of %d x %d tokens needs a new plan, and none "
                           "fits: %s", batch_size, seq_len, err)
            return None
        # the larger plan may home more on NVMe: fail with a sentence, not an ENOSPC
        preflight.check_nvme_dir(self.plugin.nvme_dir, preflight.nvme_need_bytes(
            run.plan, run.model_profile, run.plan.optimizer), num_layers=run.plan.num_layers)
        self.adopt(run, sizing)
        return run.plan

    def adopt_shape(self, previous: Plan) -> None:
        """A checkpoint's plan sized for longer batches than this run's (it re-planned
        upward before it was saved): plan for that shape too, so resuming matches it."""
        plan = self.run.plan
        tokens = previous.batch_size * previous.seq_len
        if (self.engine is None or self.engine.replan is None
                or tokens <= plan.batch_size * plan.seq_len):
            return
        sizing = batch_shape.Sizing(batch_size=previous.batch_size, seq_len=previous.seq_len,
                                    source="the checkpoint's plan", seq_cap=self.sizing.seq_cap)
        self.adopt(self.plan_for(sizing, self.run.hardware), sizing)

    def synchronize(self) -> None:
        """Wait for a running layer-wise update."""
        if self.engine is not None:
            self.engine.synchronize()

    def end(self) -> None:
        """The run ends: Ctrl-C back to Python's, no more solves, the engine detached (it
        waits for a running update first), the optimizer steps inline from now on."""
        self.guard.restore_sigint()
        if self.replanner is not None:
            self.replanner.close()
            self.replanner = None
        if self.engine is not None:
            self.engine.detach()
            self.engine = None
        if (step := installed_step(self.optimizer)) is not None:
            step.engine = None  # no engine left: step inline


def plan_for(config: LazyTrainConfig, model: nn.Module, sizing: batch_shape.Sizing,
             hardware: HardwareProfile, *, launch: Launch, layout: NodeLayout,
             budgets: Budgets, resident_update: str | None = None,
             before_attach: bool = False) -> setup.PreparedRun:
    """Profile and plan for `sizing` within `budgets`; summarize the plan unless it is
    provisional. Global rank 0 prices the workload's compute (timing the model's own
    layers `before_attach`) and solves; every rank receives both, so all run one plan.
    Every rank calls this. A re-plan passes the attached engine's `resident_update` (the
    residents stay put)."""
    compute_dtype = setup.compute_dtype_for(launch.mixed_precision)
    model_profile = setup.profile_for_run(
        model, batch_size=sizing.batch_size, seq_len=sizing.seq_len,
        compute_dtype=compute_dtype, loss_chunk_tokens=config.loss_chunk_tokens)

    def decide() -> tuple[HardwareProfile, Plan]:
        priced = hardware if sizing.provisional else shared.workload_priced(
            config, model, model_profile, hardware, device=launch.device,
            compute_dtype=compute_dtype, may_time=before_attach)
        return priced, setup.resolve_plan(
            config, model_profile, priced, resident_update=resident_update,
            gpus_per_node=layout.node_ranks, nodes=layout.nodes, budgets=budgets)

    priced, plan = ranks.from_first(decide)
    if launch.is_main_process and not sizing.provisional:
        logger.info("%s (sized from %s)", setup.format_plan_summary(plan), sizing.source)
    return setup.PreparedRun(model_profile=model_profile, hardware=priced, plan=plan)


def build_run_state(config: LazyTrainConfig, model: nn.Module, loader: Any, *,
                    launch: Launch) -> RunState:
    """Profile, plan and attach the streaming engine to `model`, sized from `loader` (None:
    from the config, or provisional until the first batch); wire the guard, the
    re-planner, the node store and the gradient reducer. The optimizer joins later."""
    from lazytrain_accel.engine import attach

    if launch.num_processes > 1:
        ranks.control_group()  # collective: every rank creates it here, before any use
    _bind_threads(config, launch)
    compute_dtype = setup.compute_dtype_for(launch.mixed_precision)
    if config.frozen_weights != "keep":  # before profiling: plan the packed base
        from lazytrain_accel.engine.memory.quantize_base import quantize_frozen_linears

        quantize_frozen_linears(model, config.frozen_weights, compute_dtype or torch.float32)
    sizing = _agreed(batch_shape.size_run(loader, model, config, seq_bound=launch.seq_bound),
                     launch)
    hardware, budgets = shared.shared_hardware(config, device=launch.device,
                                               is_main_process=launch.is_main_process)
    layout = node_layout_for(config, model, num_processes=launch.num_processes,
                             is_main_process=launch.is_main_process)
    run = plan_for(config, model, sizing, hardware, launch=launch, layout=layout,
                   budgets=budgets, before_attach=True)
    if launch.num_processes > 1:  # one model and one plan on every rank, a clean exit
        ranks.check_ranks_agree(run.plan, model, {
            name: str(getattr(config, name)) for name in ranks.PLAN_OPTIONS})
        logger.info("lazytrain: rank %d runs plan %s", ranks.global_rank(),
                    ranks.plan_digest(run.plan))
        ranks.register_exit_teardown(launch.synchronize)
    _check_host_memory(config, model, run, layout, launch)
    homed = frozenset(run.plan.state.optimizer) if layout.node_ranks > 1 else frozenset()
    store = share_store(config, model, layout, local_process_index=launch.local_process_index,
                        is_main_process=launch.is_main_process,
                        num_groups=run.plan.num_layers + 2, device=launch.device,
                        resident_update=run.plan.resident_update,
                        copies_dtype=compute_dtype,
                        split_copies=_split_sends_copies(run.plan, compute_dtype),
                        homed=homed)
    engine = attach(model, run.plan, device=launch.device, compute_dtype=compute_dtype,
                    nvme_dir=config.nvme_dir,
                    loss_chunk_tokens=setup.engine_loss_chunk_tokens(config),
                    emulation=setup.emulation_for(config, run.hardware),
                    node_copies=_node_copies(store, homed))
    guard = StepGuard(model=model, engine=engine,
                      max_nonfinite_skips=config.max_nonfinite_skips,
                      raise_on_interrupt=launch.interrupt_raises)
    state = RunState(plugin=config, launch=launch, model=model, sizing=sizing, run=run,
                     layout=layout, budgets=budgets, engine=engine, guard=guard, store=store)
    _wire_replanning(state)
    guard.install_sigint()
    _wire_reducer(state)
    return state


def _node_copies(store: node_store.NodeStore | None, homed: frozenset[int]) -> NodeCopies | None:
    """The node store's compute copies of the layers whose masters the plan homes on NVMe
    (`homed`), each updated by the rank whose masters stayed out of the store for its
    drive (`node_store.Elsewhere.kept`); None where there are none."""
    if store is None or not homed:
        return None
    return NodeCopies(copies={j: store.copies[j] for j in homed},
                      updated_here=store.kept)


def _split_sends_copies(plan: Plan, compute_dtype: torch.dtype | None) -> bool:
    """Whether a node of the split layout holds the layers other nodes update as their
    compute copy alone (what the host model prices, `planning/host.py` `master_shards`):
    the hybrid update's copies below fp32 compute; else each node holds every master,
    the compute copy cast from it."""
    return (plan.node_layout == "split" and plan.nodes > 1 and plan.optimizer == "hybrid8bit"
            and compute_dtype not in (None, torch.float32))


def _bind_threads(config: LazyTrainConfig, launch: Launch) -> None:
    if launch.num_processes > 1 and config.bind_cores == "auto" and config.threads == 0:
        ranks.bind_local_cores(local_rank=launch.local_process_index,
                               node_id=node_store.launch_identity(os.environ)[1])
    threads.apply_threads(config.threads, device=launch.device)  # before any timing


def _agreed(sizing: batch_shape.Sizing, launch: Launch) -> batch_shape.Sizing:
    """`sizing` with the largest batch and sequence any rank sized (each reads its own
    shard's first batch): every rank plans for one shape."""
    if launch.num_processes == 1:
        return sizing
    batch_size, seq_len, seq_cap = ranks.agreed_max(
        [sizing.batch_size, sizing.seq_len, sizing.seq_cap])
    return dataclasses.replace(sizing, batch_size=batch_size, seq_len=seq_len, seq_cap=seq_cap)


def _check_host_memory(config: LazyTrainConfig, model: nn.Module, run: setup.PreparedRun,
                       layout: NodeLayout, launch: Launch) -> None:
    """Before the engine allocates anything: fail with a sentence, not an OOM kill. A
    node's ranks check the node's bytes against the same (their least) free figure."""
    available = preflight.available_host_bytes()
    estimate = preflight.check_run(
        model=model, plan=run.plan, model_profile=run.model_profile,
        optimizer=config.optimizer.value, nvme_dir=config.nvme_dir,
        checkpoint_dtype=config.checkpoint_dtype,
        available_bytes=available if layout.node_ranks == 1 else ranks.least(available))
    if layout.segment_room is not None:  # a copy per rank, if they all fit
        warning = preflight.check_per_rank_copies(
            layout.segment_room, estimate, available_bytes=ranks.least(available),
            copies=int(os.environ["LOCAL_WORLD_SIZE"]))
        if launch.is_main_process:
            logger.warning("lazytrain: %s", warning)


def _wire_replanning(state: RunState) -> None:
    """A batch beyond the plan re-plans upward, every rank for the largest batch any runs;
    `replan="auto"` follows the measured rates, on several ranks as rank 0 decides from
    all of theirs (`run/replan_ranks.py`). A plan file is the user's: never re-planned."""
    config, engine = state.plugin, state.engine
    if setup.is_plan_file(config):
        return
    engine.replan = state.replan
    if state.launch.num_processes > 1:  # one shape on every rank: they re-plan together
        engine.agree_shape = lambda batch, seq: tuple(ranks.agreed_max([batch, seq]))
    if config.replan != "auto":
        return
    if state.launch.num_processes == 1:
        state.replanner = replanner_for(config, engine=engine, state=state,
                                        budgets=state.budgets)
        return
    totals = LaunchTotals(engine)
    state.replanner = LaunchReplanner(state=state, totals=totals, replanner=replanner_for(
        config, engine=totals, state=state, budgets=state.budgets)
        if ranks.global_rank() == 0 else None)


def _wire_reducer(state: RunState) -> None:
    """The gradients' way between ranks: split across a node store's ranks (each updates
    its share), else all-reduced whole; one process has none."""
    engine, launch = state.engine, state.launch
    split = engine.plan.node_layout == "split"
    if split and state.store is None:
        raise ValueError("node_layout='split' divides each node's store over the nodes, but "
                         "this launch keeps a copy per rank (node_store='off', or no store "
                         "could be mapped: see the lines above); use node_layout='replicated'")
    if state.store is not None:
        copies = _split_sends_copies(engine.plan, engine.compute_dtype)
        _, node_id = node_store.launch_identity(os.environ)
        groups = node_groups(local_rank=launch.local_process_index,
                             local_world_size=state.layout.node_ranks, node_id=node_id,
                             split=split)
        state.reducer, state.homed = split_update.start_split_update(
            engine, generations=state.store.generations, layout=groups,
            should_reduce=launch.should_reduce, node_layout=engine.plan.node_layout,
            copies=state.store.copies if copies else None)
        if copies or state.homed is not None:  # masters of others: placeholders here
            node_exchange.refuse_partial_state_dicts(state.model)
        _pin_store(state)
    elif launch.num_processes > 1:
        state.reducer = GradientAllReducer(engine, state.model,
                                           should_reduce=launch.should_reduce)


def _pin_store(state: RunState) -> None:
    """Page-lock the node store for the device's copies, in chunks; where any local rank
    could not (warned there), every rank re-plans on the pageable copy rates, so the ranks
    keep one plan (`ranks.check_ranks_agree`)."""
    max_chunk_bytes = int(state.plugin.pin_chunk_max_gib * 1024**3)
    pinned = state.engine.streams.register_pinned(state.store.bytes,
                                                  max_chunk_bytes=max_chunk_bytes)
    if ranks.least(int(pinned)):
        return
    state.adopt(state.plan_for(state.sizing, state.run.hardware.pageable_links()))
