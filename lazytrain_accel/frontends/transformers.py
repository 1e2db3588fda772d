"""HF Trainer integration: `--lazytrain` on `TrainingArguments`, and the Trainer it drives.

Two ways in:

* `LazyTrainTrainingArguments` + `LazyTrainTrainer` for scripts that import them;
* `apply_lazytrain_to_trainer(trainer)` for an already-built Trainer (one's own subclass),
  which is also what `python -m lazytrain_accel.launch` calls on every Trainer an
  unmodified script builds.

Everything is patched on the *instance* (Liger-Kernel style), so other Trainers in the
same process stay stock. What changes on a LazyTrain Trainer: the model never moves to the
device whole; its accelerator is `TrainerAccelerator` with the plugin (profile, plan,
engine, hybrid 8-bit optimizer at `prepare`); no `nn.DataParallel`; checkpoints also hold
the plan; `LazyTrainCallback` adds the plan and measured stalls to the logs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from lazytrain_accel.config import LazyTrainConfig, OptimizerChoice
from lazytrain_accel.frontends.trainer_accelerator import TrainerAccelerator
from lazytrain_accel.frontends.trainer_callback import LazyTrainCallback, quiet_console
from lazytrain_accel.frontends.trainer_checkpoint import (
    load_shared_optimizer,
    make_checkpoints_atomic,
    save_scheduler,
)
from lazytrain_accel.frontends.trainer_config import load_lazytrain_config
from lazytrain_accel.run.batch_shape import seq_bound_of

logger = logging.getLogger("lazytrain_accel")

__all__ = ["LazyTrainCallback", "LazyTrainTrainer", "LazyTrainTrainingArguments",
           "apply_lazytrain_to_trainer", "load_lazytrain_config"]


@dataclass(kw_only=True)
class LazyTrainTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus `--lazytrain` and `--lazytrain_config`.

    Only the two switches are added: every LazyTrain setting that is not already a
    TrainingArguments flag lives in `lazytrain_config` (the `LazyTrainPlugin` fields).
    Stock flags keep their meaning: `max_grad_norm` is the clip of the fused update,
    `bf16`/`fp16` the compute dtype of the streamed layers, `optim` the optimizer when set.
    """

    lazytrain: bool = field(default=False, metadata={
        "help": "Stream the model's layers through the device with LazyTrain (plan + engine "
                "+ hybrid 8-bit CPU optimizer)."})
    lazytrain_config: dict | str | None = field(default=None, metadata={
        "help": "LazyTrainPlugin fields: a YAML/JSON file or an inline JSON object, e.g. "
                "'{\"plan\": \"auto\", \"hardware\": \"rtx3090\"}'."})

    def __post_init__(self) -> None:
        if self.lazytrain:
            refuse_incompatible_arguments(self)
        super().__post_init__()
        #: the parsed plugin (None without --lazytrain); not a field, so not on the CLI.
        self.lazytrain_plugin = (load_lazytrain_config(self.lazytrain_config)
                                 if self.lazytrain else None)

    @property
    def place_model_on_device(self) -> bool | None:
        return False if self.lazytrain else super().place_model_on_device


def refuse_incompatible_arguments(args: TrainingArguments) -> None:
    """Raise ValueError for TrainingArguments that cannot run with LazyTrain."""
    if getattr(args, "deepspeed", None):
        raise ValueError(f"--deepspeed {args.deepspeed!r} cannot be combined with --lazytrain: "
                         "both stream/shard the model and own the optimizer. Drop one of them.")
    if getattr(args, "fsdp", None):
        raise ValueError(f"--fsdp {args.fsdp!r} cannot be combined with --lazytrain: LazyTrain "
                         "streams the whole model through one device per process. Drop one.")
    # --gradient_checkpointing (TRL's default) is absorbed: the engine turns HF's
    # checkpointing off on the streamed model and the plan decides recompute.


class LazyTrainTrainer(Trainer):
    """`Trainer` that runs with LazyTrain when `args.lazytrain` is set (or, with stock
    `TrainingArguments`, always), configured by `args.lazytrain_config` or the
    `lazytrain_config=` keyword (a `LazyTrainPlugin`, dict or file path)."""

    def __init__(self, *args: Any, lazytrain_config: LazyTrainConfig | dict | str | None = None,
                 **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        config = _config_for(training_args, lazytrain_config)
        if config is not None:
            prepare_trainer_init(self)
        super().__init__(*args, **kwargs)
        if config is not None:
            apply_lazytrain_to_trainer(self, config)


def _config_for(args: TrainingArguments | None,
                explicit: LazyTrainConfig | dict | str | None) -> LazyTrainConfig | None:
    if explicit is not None:
        return load_lazytrain_config(explicit)
    if args is not None and hasattr(args, "lazytrain"):
        return args.lazytrain_plugin if args.lazytrain else None
    return load_lazytrain_config(None)


def prepare_trainer_init(trainer: Trainer) -> None:
    """Instance overrides that must exist *before* `Trainer.__init__` runs: keep the
    model on the host, and record the accelerator arguments Trainer builds."""
    trainer._move_model_to_device = MethodType(_keep_model_on_host, trainer)
    stock_build = trainer._build_accelerator_args

    def capture(**kwargs: Any) -> dict[str, Any]:
        built = stock_build(**kwargs)
        trainer._lazytrain_accelerator_args = dict(built)
        return built

    trainer._build_accelerator_args = capture


def _keep_model_on_host(self: Trainer, model: torch.nn.Module, device: torch.device) -> None:
    logger.info("lazytrain: keeping the model on the host; its layers stream to %s", device)


def apply_lazytrain_to_trainer(trainer: Trainer,
                               config: LazyTrainConfig | dict | str | None = None) -> Trainer:
    """Turn an already-built Trainer (any subclass) into a LazyTrain one, in place.

    Call it before `trainer.train()`. For a model too large for the device, build the
    Trainer with `LazyTrainTrainingArguments(lazytrain=True, ...)` (or through
    `LazyTrainTrainer`), which never moves the model; a model a stock Trainer already moved
    to the device is moved back to the host here. Returns the trainer.
    """
    if getattr(trainer, "_lazytrain_applied", False):
        return trainer
    config = load_lazytrain_config(config if config is not None
                                   else getattr(trainer.args, "lazytrain_plugin", None))
    refuse_incompatible_arguments(trainer.args)
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError("this Trainer runs with DeepSpeed/FSDP (from `accelerate config` or "
                         "its arguments), which cannot be combined with LazyTrain: drop one")
    config = _respect_user_optimizer(trainer, config)
    if "_move_model_to_device" not in vars(trainer):
        trainer._move_model_to_device = MethodType(_keep_model_on_host, trainer)
    trainer.place_model_on_device = False
    _move_back_to_host(trainer.model)
    if trainer.args.n_gpu > 1:  # Trainer would wrap the model in nn.DataParallel
        trainer.args._n_gpu = 1
    _follow_log_level(trainer.args)
    _install_accelerator(trainer, config)
    _record_sizing_loaders(trainer)
    _save_plan_with_checkpoints(trainer)
    make_checkpoints_atomic(trainer)
    trainer.callback_handler.callbacks.insert(0, LazyTrainCallback(trainer))
    quiet_console(trainer)
    trainer._lazytrain_applied = True
    return trainer


def _follow_log_level(args: TrainingArguments) -> None:
    """LazyTrain's messages follow the Trainer's `--log_level` (INFO shows the plan); with
    the default "passive" level only warnings show, as for transformers' own messages."""
    level = args.get_process_log_level()
    ours = logging.getLogger("lazytrain_accel")
    if level < 0 or args.log_level == "passive":
        return
    ours.setLevel(level)
    if not ours.handlers and not logging.getLogger().handlers:
        ours.addHandler(logging.StreamHandler())


def _respect_user_optimizer(trainer: Trainer, config: LazyTrainConfig) -> LazyTrainConfig:
    """The hybrid 8-bit operator is the default, not an override: if the user chose an
    optimizer (`optimizers=`, `optimizer_cls_and_kwargs`, a non-default `--optim` or their
    own `create_optimizer`) and did not ask for "hybrid8bit" explicitly, keep theirs."""
    if config.is_explicit("optimizer") or config.optimizer == OptimizerChoice.KEEP:
        return config
    default_optim = TrainingArguments.__dataclass_fields__["optim"].default
    chosen = [
        reason for reason, yes in (
            ("an optimizer passed to Trainer(optimizers=...)", trainer.optimizer is not None),
            ("optimizer_cls_and_kwargs", getattr(trainer, "optimizer_cls_and_kwargs", None)
             is not None),
            (f"--optim {OptimizerNames(trainer.args.optim).value}",
             OptimizerNames(trainer.args.optim) != OptimizerNames(default_optim)),
            ("an overridden create_optimizer",
             type(trainer).create_optimizer is not Trainer.create_optimizer),
        ) if yes
    ]
    if not chosen:
        return config
    logger.warning("lazytrain: keeping the optimizer you chose (%s); pass lazytrain_config "
                   "optimizer='hybrid8bit' to replace it by the hybrid 8-bit operator",
                   chosen[0])
    return dataclasses.replace(config, optimizer=OptimizerChoice.KEEP)


def _move_back_to_host(model: torch.nn.Module | None) -> None:
    if model is None:
        return
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        logger.warning("lazytrain: the Trainer had moved the model to %s whole; moving it back "
                       "to the host (build the Trainer with LazyTrainTrainingArguments("
                       "lazytrain=True) to avoid the round trip)", sorted(devices - {"cpu"}))
        model.to("cpu")


def _install_accelerator(trainer: Trainer, config: LazyTrainConfig) -> None:
    """Replace the Trainer's accelerator by ours, built from the very arguments Trainer
    gave its own (mixed precision, dataloader config, DDP kwargs...)."""
    if not hasattr(trainer, "_lazytrain_accelerator_args"):
        # Built without `prepare_trainer_init`: rebuild once to see the arguments.
        prepare_trainer_init(trainer)
        trainer.create_accelerator_and_postprocess()
    del trainer._build_accelerator_args  # back to the class's method
    trainer.accelerator = TrainerAccelerator(**trainer._lazytrain_accelerator_args, plugin=config)
    # TRL states the longest sequence (max_length): plan for it, not for the first batch
    trainer.accelerator.lazytrain_seq_bound = seq_bound_of(trainer.args)
    gather = trainer.accelerator.gather_for_metrics
    if "use_gather_object" in inspect.signature(gather).parameters:
        gather = functools.partial(gather, use_gather_object=trainer.args.eval_use_gather_object)
    trainer.gather_function = gather


def _record_sizing_loaders(trainer: Trainer) -> None:
    """Trainer prepares the model with no DataLoader: size the plan from the train loader
    (or, when `evaluate()` comes first, from the eval loader it builds)."""

    def recording(stock: Any, batch_size: Any, *, overrides: bool) -> Any:
        def get_dataloader(*args: Any, **kwargs: Any) -> Any:
            loader = stock(*args, **kwargs)
            accelerator = trainer.accelerator
            if overrides or accelerator.lazytrain_sizing_loader is None:
                # The prepared loader reports its sampler shard's batch, not the per-device
                # batch; a plain loader over the same samples and collator has the real shape.
                accelerator.lazytrain_sizing_loader = torch.utils.data.DataLoader(
                    loader.dataset, batch_size=batch_size(), collate_fn=loader.collate_fn)
            return loader
        return get_dataloader

    trainer.get_train_dataloader = recording(
        trainer.get_train_dataloader, lambda: trainer._train_batch_size, overrides=True)
    trainer.get_eval_dataloader = recording(
        trainer.get_eval_dataloader, lambda: trainer.args.eval_batch_size, overrides=False)


def _save_plan_with_checkpoints(trainer: Trainer) -> None:
    """The plan goes beside the optimizer state; on resume, a plan made for another run
    is reported (the math does not depend on the plan, so training continues)."""
    from lazytrain_accel.frontends.accelerate import PLAN_FILE
    from lazytrain_accel.planning import Plan

    stock_save = trainer._save_optimizer_and_scheduler
    stock_load = trainer._load_optimizer_and_scheduler

    def save(output_dir: str) -> None:
        lazytrain = getattr(trainer.accelerator, "lazytrain", None)
        if lazytrain is not None and (lazytrain.store is not None or getattr(
                trainer, "_lazytrain_saving_shares", False)):
            save_scheduler(trainer, output_dir)  # the optimizer: one share file per rank
        else:
            stock_save(output_dir)
        if lazytrain is not None and trainer.args.should_save:
            lazytrain.run.plan.save(Path(output_dir) / PLAN_FILE)

    def load(checkpoint: str | None) -> None:
        from lazytrain_accel.checkpoints.share_format import MANIFEST

        lazytrain = getattr(trainer.accelerator, "lazytrain", None)
        if checkpoint and lazytrain is not None and lazytrain.optimizer is not None and (
                lazytrain.store is not None or (Path(checkpoint) / MANIFEST).is_file()):
            load_shared_optimizer(trainer, checkpoint)  # per share, re-sharded
        else:
            stock_load(checkpoint)
        saved = Path(checkpoint) / PLAN_FILE if checkpoint else None
        if lazytrain is None or saved is None or not saved.is_file():
            return
        previous = Plan.load(saved)
        trainer.accelerator.lazytrain_adopt_shape(previous)
        if previous.fingerprint != lazytrain.run.plan.fingerprint:
            logger.warning("lazytrain: %s was planned for another model shape or machine; "
                           "resuming with this run's plan (results are unaffected)", saved)

    trainer._save_optimizer_and_scheduler = save
    trainer._load_optimizer_and_scheduler = load
