"""What `prepare` does for every front end (Accelerate, Trainer, `lazytrain demo`):
profile the model and the hardware, get a plan (cached by fingerprint), attach the
engine, and build the optimizer on the host masters.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lazytrain_accel.config import STRATEGIES, LazyTrainConfig, OptimizerChoice
from lazytrain_accel.engine.device.emulation import EmulationSettings
from lazytrain_accel.optim import native
from lazytrain_accel.planning import Budgets, Plan, PlanRequest
from lazytrain_accel.profiling.fingerprint import run_fingerprint
from lazytrain_accel.profiling.hardware import MEASURED_NAME_PREFIX, HardwareProfile
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.live import geometry_from_model, weight_split_from_model
from lazytrain_accel.profiling.model_configs import FAMILIES, geometry_from_config, profile_model
from lazytrain_accel.profiling.profile import ModelGeometry, ModelProfile

logger = logging.getLogger("lazytrain_accel")


@dataclass(kw_only=True)
class PreparedRun:
    """Everything `prepare` decided, kept on the Accelerator / Trainer for later use."""

    model_profile: ModelProfile
    hardware: HardwareProfile
    plan: Plan


def compute_dtype_for(mixed_precision: str | None) -> torch.dtype | None:
    """The dtype the streamed weight copies take on the device (None = keep fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision or "no"))


def hardware_for_backend(config: LazyTrainConfig, hardware: HardwareProfile
                         ) -> HardwareProfile:
    """`hardware` as the engine's backend will run: the emulated async device stands in
    for a GPU, so the residents' device update runs beside the host's there too
    (`StepCoordinator`), and the simulator must model it that way
    (`device_runs_async`; a profile measured on this CPU says otherwise), but its compute
    is the training thread, which also stages and folds (`compute_on_host`)."""
    if config.emulate_async and not (hardware.device_runs_async and hardware.compute_on_host):
        hardware = dataclasses.replace(hardware, device_runs_async=True, compute_on_host=True)
    return hardware_for_optimizer(config, hardware)


def hardware_for_optimizer(config: LazyTrainConfig, hardware: HardwareProfile
                           ) -> HardwareProfile:
    """`hardware` with the host update rate the run will get. A preset's rate is the native
    kernel's; where the kernel could not be built (`load_kernel` warned, once) the 8-bit
    optimizer runs reference.py's torch path, `TORCH_PATH_SLOWDOWN` times slower, and the
    plan must price that instead of hiding it. A measured profile timed the path that runs."""
    if (config.optimizer != OptimizerChoice.HYBRID8BIT
            or hardware.name.startswith(MEASURED_NAME_PREFIX)
            or native.load_kernel() is not None):
        return hardware
    rate = hardware.cpu_optimizer_params_per_s / native.TORCH_PATH_SLOWDOWN
    return dataclasses.replace(
        hardware, cpu_optimizer_params_per_s=rate,
        source=f"{hardware.source}; host update {rate:.2e} params/s: the profile's rate / "
               f"{native.TORCH_PATH_SLOWDOWN:.0f}, the torch path's (no native kernel)")


def emulation_for(config: LazyTrainConfig, hardware: HardwareProfile) -> EmulationSettings | bool:
    """The emulated async device `config` asks for on a CPU (False: the synchronous one);
    `emulate_links="profile"` throttles each link to `hardware`'s rate, a hardware JSON
    path to that profile's (the machine drifts from the profile the plan is made for)."""
    if not config.emulate_async:
        return False
    if config.emulate_links == "off":
        return EmulationSettings(seed=config.emulate_seed)
    links = hardware if config.emulate_links == "profile" else load_hardware(
        config.emulate_links)
    rates = {"h2d": links.h2d_bytes_per_s, "d2h": links.d2h_bytes_per_s,
             "nvme_read": links.nvme_read_bytes_per_s,
             "nvme_write": links.nvme_write_bytes_per_s}
    return EmulationSettings(seed=config.emulate_seed, link_bytes_per_s=rates)


def profile_for_run(model: nn.Module, *, batch_size: int, seq_len: int,
                    compute_dtype: torch.dtype | None,
                    loss_chunk_tokens: int | str = 0) -> ModelProfile:
    """The model's profile at the run's shape; `loss_chunk_tokens` (the config's) sizes
    the head's working bytes: full logits at 0, one chunk of them with the fused loss,
    the planner's choice at "auto". The layers' tiles and attention query blocks are the
    planner's choice (`tile_tokens=None`): untiled where the untiled working set fits."""
    from lazytrain_accel.engine.model.discovery import find_decoder_layers

    elem_bytes = 4 if compute_dtype is None else torch.empty((), dtype=compute_dtype).element_size()
    weights = weight_split_from_model(model, list(find_decoder_layers(model)[2]))
    return profile_model(geometry_for_run(model), batch_size=batch_size, seq_len=seq_len,
                         compute_bytes_per_elem=elem_bytes,
                         loss_chunk_tokens=None if loss_chunk_tokens == "auto"
                         else loss_chunk_tokens, weights=weights, tile_tokens=None)


def geometry_for_run(model: nn.Module) -> ModelGeometry:
    """The geometry of the live model (its own parameters, any decoder-only family).

    Where the config-based family table also knows the model and agrees on the counts,
    its geometry is used, so a plan made by `lazytrain plan --model <config.json>` keeps
    the same fingerprint as the run; a disagreement is said and the live count wins.
    """
    from lazytrain_accel.engine.model.discovery import find_decoder_layers

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"{type(model).__name__} has no HF `config`: LazyTrain streams "
                        "HuggingFace decoder-only causal LMs (PreTrainedModel)")
    live = geometry_from_model(model, list(find_decoder_layers(model)[2]))
    if getattr(config, "model_type", None) not in FAMILIES:
        return live
    table = geometry_from_config(config.to_dict(), name=getattr(config, "name_or_path", ""))
    if (table.layer_param_count, table.total_param_count) == (live.layer_param_count,
                                                              live.total_param_count):
        return table
    logger.info("lazytrain: the %s family table counts %d parameters per layer and %d in "
                "all, the live model %d and %d; planning with the live counts",
                table.family, table.layer_param_count, table.total_param_count,
                live.layer_param_count, live.total_param_count)
    return live


def is_plan_file(config: LazyTrainConfig) -> bool:
    """Whether `config.plan` names a plan file (not "auto" or a strategy)."""
    return config.plan not in ("auto", *STRATEGIES)


def engine_loss_chunk_tokens(config: LazyTrainConfig) -> int | str:
    """The fused loss's chunk the engine uses: the config's, or at "auto" the plan's
    ("auto": the engine also follows a new plan's on a re-plan)."""
    chunk = config.loss_chunk_tokens
    return "auto" if chunk == "auto" else int(chunk)


def resolve_plan(config: LazyTrainConfig, model_profile: ModelProfile,
                 hardware: HardwareProfile, *, resident_update: str | None = None,
                 gpus_per_node: int = 1, nodes: int = 1, budgets: Budgets | None = None
                 ) -> Plan:
    """The plan named by `config.plan`, solved or loaded from the cache, fingerprint-checked;
    `resident_update` overrides the config's (a re-plan passes its engine's);
    `gpus_per_node`: the local ranks sharing this host's copy (a node store), planned as
    one node (`planning/node.py`), of `nodes` such nodes; `budgets`: the launch's
    (`run/shared.py`), default `config`'s on `hardware`."""
    fingerprint = run_fingerprint(model_profile, hardware)
    if is_plan_file(config):
        plan = Plan.load(config.plan)
        plan.check_fingerprint(fingerprint)
        return plan
    strategy = "lazytrain" if config.plan == "auto" else config.plan
    resident_update = resident_update or config.resident_update
    budgets = budgets or budgets_for(config, hardware)
    # the rates too (the fingerprint leaves them out): a calibrated profile plans anew
    rates = {k: v for k, v in hardware.to_dict().items() if k.endswith("_per_s")}
    key = json.dumps([fingerprint, strategy, budgets.gpu_bytes, budgets.cpu_bytes,
                      budgets.nvme_bytes, config.max_recompute_block,
                      config.loss_chunk_tokens, config.optimizer.value, resident_update,
                      gpus_per_node, nodes, config.node_layout,
                      streamed_state(config, gpus_per_node),
                      rates], sort_keys=True)
    cache_path = Path(config.cache_dir) / "plans" / f"{_short_hash(key)}.json"
    if cache_path.is_file():
        try:
            plan = Plan.load(cache_path)
            plan.check_fingerprint(fingerprint)
            logger.info("lazytrain: using cached plan %s", cache_path)
            return plan
        except ValueError as err:  # stale or damaged cache entry: plan again
            logger.warning("lazytrain: ignoring cached plan %s (%s)", cache_path, err)
    plan = _make_or_explain(config, model_profile, hardware, strategy=strategy,
                            budgets=budgets, resident_update=resident_update,
                            gpus_per_node=gpus_per_node, nodes=nodes)
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(cache_path)
    except OSError as err:  # a read-only cache must not stop training
        logger.warning("lazytrain: could not cache the plan in %s (%s)", cache_path, err)
    return plan


def _make_or_explain(config: LazyTrainConfig, model_profile: ModelProfile,
                     hardware: HardwareProfile, *, strategy: str, budgets: Budgets,
                     resident_update: str, gpus_per_node: int, nodes: int) -> Plan:
    """`make_plan`, or a `BatchInfeasibleError` that also names the largest batch that fits."""
    from lazytrain_accel.planning import PlanInfeasibleError, make_plan
    from lazytrain_accel.planning.infeasible import with_largest_batch

    request = plan_request(config, strategy=strategy, budgets=budgets,
                           resident_update=resident_update, gpus_per_node=gpus_per_node,
                           nodes=nodes)
    try:
        return make_plan(model_profile, hardware, request)
    except PlanInfeasibleError as err:
        def profile_at(batch_size: int) -> ModelProfile:
            return profile_model(model_profile.geometry, batch_size=batch_size,
                                 seq_len=model_profile.seq_len,
                                 compute_bytes_per_elem=model_profile.compute_bytes_per_elem,
                                 loss_chunk_tokens=model_profile.loss_chunk_tokens,
                                 weights=model_profile.weights)

        raise with_largest_batch(err, profile_at, hardware, request,
                                 batch_size=model_profile.batch_size,
                                 seq_len=model_profile.seq_len) from None


def plan_request(config: LazyTrainConfig, *, strategy: str, budgets: Budgets,
                 resident_update: str, gpus_per_node: int = 1, nodes: int = 1,
                 time_limit_s: float | None = None, running: Plan | None = None
                 ) -> PlanRequest:
    """`make_plan`'s request from `config` (the prediction includes the host update where
    the hybrid 8-bit one runs it); `time_limit_s` overrides the config's solver limit;
    `running`: the plan a re-plan runs now (never returned slower than it). Across
    nodes the plan prices the layout `config.node_layout` names."""
    return PlanRequest(strategy=strategy, budgets=budgets,
                       max_recompute_block=config.max_recompute_block,
                       time_limit_s=(config.solver_time_limit_s if time_limit_s is None
                                     else time_limit_s),
                       include_optimizer=config.optimizer == OptimizerChoice.HYBRID8BIT,
                       resident_update=resident_update, gpus_per_node=gpus_per_node,
                       nodes=nodes, node_layout=config.node_layout, running=running,
                       host_state=streamed_state(config, gpus_per_node))


def streamed_state(config: LazyTrainConfig, gpus_per_node: int = 1) -> str:
    """The parts of the layers' host state a run may home on NVMe (`PlanRequest.host_state`):
    the compute copies where each rank keeps its own host copy; under the hybrid 8-bit
    operator, which updates layer by layer, what the planner allows ("auto") in one
    process (every part) and on the ranks sharing a node store (`gpus_per_node` > 1: the
    masters and moments, `request.NODE_STATE_PARTS`)."""
    from lazytrain_accel.distributed import ranks

    if config.optimizer != OptimizerChoice.HYBRID8BIT:
        return "copies"
    return "auto" if gpus_per_node > 1 or not ranks.is_multi_process() else "copies"


def budgets_for(config: LazyTrainConfig, hardware: HardwareProfile) -> Budgets:
    """The planner's budgets: the config's limits, else `hardware`'s capacities."""
    return Budgets.from_hardware(hardware, gpu_memory_limit_gb=config.gpu_memory_limit_gb,
                                 cpu_memory_limit_gb=config.cpu_memory_limit_gb,
                                 nvme_limit_gb=config.nvme_limit_gb)


def solve_plan(config: LazyTrainConfig, model_profile: ModelProfile,
               hardware: HardwareProfile, *, resident_update: str,
               time_limit_s: float, budgets: Budgets | None = None,
               gpus_per_node: int = 1, running: Plan | None = None) -> Plan:
    """A new plan of `config`'s strategy on `hardware` (no cache, no refusal search) within
    `time_limit_s`: what the re-planner solves on its thread, never priced slower than the
    `running` plan it may replace. Raises `PlanInfeasibleError` when none fits."""
    from lazytrain_accel.planning import make_plan

    strategy = "lazytrain" if config.plan == "auto" else config.plan
    request = plan_request(config, strategy=strategy,
                           budgets=budgets or budgets_for(config, hardware),
                           resident_update=resident_update, gpus_per_node=gpus_per_node,
                           time_limit_s=time_limit_s, running=running)
    return make_plan(model_profile, hardware, request)


def _short_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:24]


def build_optimizer(config: LazyTrainConfig, user_optimizer: torch.optim.Optimizer | None,
                    model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer that steps the host masters.

    With `optimizer="hybrid8bit"` the user's optimizer is replaced by `HybridAdamW8bit`
    sharing the *same* param-group dicts, so an LR scheduler built on the user's optimizer
    (before or after `prepare`) still drives the update. With "keep" the user's optimizer
    is used as is: the engine keeps `param.data` as the host fp32 master, so it already
    steps the right tensors.
    """
    from lazytrain_accel.optim import HybridAdamW8bit

    if user_optimizer is None:
        return HybridAdamW8bit(model.parameters())
    import accelerate

    if isinstance(user_optimizer, accelerate.optimizer.AcceleratedOptimizer):
        user_optimizer = user_optimizer.optimizer
    if config.optimizer == OptimizerChoice.KEEP or isinstance(user_optimizer, HybridAdamW8bit):
        return user_optimizer
    _check_replaceable(user_optimizer)
    hyper = dict(user_optimizer.defaults)
    kwargs = {k: hyper[k] for k in ("lr", "betas", "eps", "weight_decay") if k in hyper}
    if isinstance(user_optimizer, (torch.optim.Adam,)) and not isinstance(
            user_optimizer, torch.optim.AdamW) and kwargs.get("weight_decay"):
        logger.warning("lazytrain: replacing torch.optim.Adam (L2 weight decay) by "
                       "HybridAdamW8bit (decoupled weight decay); pass optimizer='keep' to "
                       "keep Adam")
    replacement = HybridAdamW8bit(
        [{"params": list(g["params"])} for g in user_optimizer.param_groups], **kwargs)
    logger.info("lazytrain: optimizer %s replaced by HybridAdamW8bit (8-bit moments on the "
                "host, same param groups, lr/betas/eps/weight_decay); to keep yours pass "
                "optimizer='keep' (LazyTrainPlugin, LAZYTRAIN_OPTIMIZER or --lazytrain_config)",
                type(user_optimizer).__name__)
    for ours, theirs in zip(replacement.param_groups, user_optimizer.param_groups, strict=True):
        for key, value in ours.items():
            theirs.setdefault(key, value)
    # Share the group dicts: schedulers on either object now drive the same lr.
    replacement.param_groups = user_optimizer.param_groups
    replacement.register_load_state_dict_post_hook(_keep_groups_shared(user_optimizer))
    # A scheduler built on the user's optimizer checks that *its* step ran first: the
    # run's step marks it (`run/step.py:OptimizerStep.install`, `replaced=`).
    return replacement


def _check_replaceable(user_optimizer: torch.optim.Optimizer) -> None:
    """The swap keeps lr/betas/eps/weight_decay and drops the class: refuse it where that
    changes the math (an SGD learning rate used as AdamW's diverges) instead of training
    something else than what the user wrote."""
    name = type(user_optimizer).__name__
    keep = (f"pass LazyTrainPlugin(optimizer='keep') (or LAZYTRAIN_OPTIMIZER=keep) to step "
            f"your {name} on the host masters")
    hyper = user_optimizer.defaults
    # bitsandbytes' and other AdamW ports are named *Adam* and carry the same fields.
    adam_like = isinstance(user_optimizer, torch.optim.Adam | torch.optim.AdamW) or (
        "adam" in name.lower() and "betas" in hyper)
    if not adam_like or not isinstance(hyper.get("lr"), float | int):
        raise ValueError(
            f"optimizer='hybrid8bit' replaces your optimizer by AdamW with 8-bit moments, "
            f"reusing its lr/betas/eps/weight_decay; {name} (lr={hyper.get('lr')!r}) is not "
            f"an Adam-family optimizer, so its hyperparameters mean something else. Build "
            f"torch.optim.AdamW instead, or {keep}")
    unsupported = sorted({key for group in user_optimizer.param_groups
                          for key in ("amsgrad", "maximize") if group.get(key)})
    if unsupported:
        raise ValueError(
            f"{name} has {', '.join(f'{k}=True' for k in unsupported)}, which the hybrid "
            f"8-bit AdamW does not implement; drop it, or {keep}")


def _keep_groups_shared(user_optimizer: torch.optim.Optimizer):
    """`Optimizer.load_state_dict` rebinds `param_groups` to new dicts; copy the loaded
    hyperparameters back into the shared dicts so the user's scheduler keeps driving."""
    shared = user_optimizer.param_groups

    def hook(optimizer: torch.optim.Optimizer) -> None:
        for loaded, group in zip(optimizer.param_groups, shared, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        optimizer.param_groups = shared

    return hook


def format_plan_summary(plan: Plan) -> str:
    """One screen about the plan: tiers, blocks, predicted step time, exposure, solver."""
    homes = plan.count_homes()
    blocks = [f"{s}-{e}" for s, e in plan.blocks if e - s > 1]
    pred, solver = plan.prediction, plan.solver
    gib = 1024**3
    lines = [
        f"LazyTrain plan '{plan.strategy}': {plan.num_layers} layers, batch {plan.batch_size}"
        f" x seq {plan.seq_len}, {plan.boundary_bytes / 2**20:.1f} MiB per boundary",
        f"  boundaries: gpu {homes['gpu']}, cpu {homes['cpu']}, nvme {homes['nvme']}, "
        f"recomputed {homes['recompute']}",
        f"  recompute blocks: {', '.join(blocks) if blocks else 'none'}",
        f"  predicted step {pred.step_s:.3f} s (compute {pred.compute_s:.3f}, recompute "
        f"{pred.recompute_s:.3f}, exposed {pred.exposed_s:.3f}, of it host optimizer "
        f"{pred.optimizer_exposed_s:.3f}), {pred.tokens_per_s:,.0f} tok/s",
        "  loss head: " + (f"fused chunked loss, {plan.loss_chunk_tokens} tokens per chunk "
                           "(training outputs carry logits=None)" if plan.loss_chunk_tokens
                           else "the model's own loss"),
        f"  predicted peaks: gpu {pred.peak_gpu_bytes / gib:.2f} GiB, cpu "
        f"{pred.peak_cpu_bytes / gib:.2f} GiB, nvme {pred.peak_nvme_bytes / gib:.2f} GiB",
        *([f"  host state on NVMe (layers): masters and moments {len(plan.state.optimizer)}, "
           f"gradients {len(plan.state.grads)}, compute copies {len(plan.state.copies)}"]
          if plan.state.any else []),
        f"  solver: {solver.status}, {solver.solve_s:.2f} s, gap {solver.gap:.2%}"
        + (f" ({solver.message})" if solver.message else ""),
    ]
    return "\n".join(lines)
