"""Atomic Trainer checkpoints: `checkpoint-N` appears whole or not at all.

Each save goes to a staging folder beside `checkpoint-N`, is flushed, then renamed into
place (`checkpoints.atomic`); rotation runs only after the rename. Replicated ranks save
through `publication.save_on_every_rank` (one temporary directory rank 0 publishes); under
the node store through `share_checkpoint.save_shares` (every rank's stock save in a folder
of its own, its `optimizer_share_<r>.safetensors`, the manifest; no `optimizer.pt`). Asynchronous
(`checkpoint_mode="async"`, the default with the layer-wise update): `_save_checkpoint`
writes the stock files of the save's step, starts the writer `save_state` uses
(`checkpoints/asynchronous.py`) and returns. `save_only_model`, a model that is not a
`PreTrainedModel` or `checkpoint_mode="sync"`: synchronous, the log line says why (the
last, with state homed on NVMe: that writer, waited for; it copies the state's files).
Docs: docs/trainer.md "Checkpoints", docs/user_guide.md "8. Checkpoints".
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from lazytrain_accel.checkpoints.atomic import fsync_dir, fsync_tree, owner_alive, recover
from lazytrain_accel.checkpoints.publication import save_on_every_rank
from lazytrain_accel.checkpoints.share_format import check_weights_complete, read_manifest
from lazytrain_accel.frontends import share_checkpoint

logger = logging.getLogger("lazytrain_accel")

STAGING_PREFIX = ".lazytrain-staging-"
#: Loggers whose messages name the folder a checkpoint is being written to.
_SAVE_LOGGERS = ("transformers.trainer", "transformers.modeling_utils",
                 "transformers.configuration_utils", "transformers.tokenization_utils_base",
                 "transformers.generation.configuration_utils")


#: `_synchronous_because` for a Trainer set to save synchronously.
SYNC_SETTING = "checkpoint_mode='sync'"


def make_checkpoints_atomic(trainer: Trainer) -> None:
    """Route this Trainer instance's `_save_checkpoint` through a staging folder, or
    beside training (module docstring); the end of `train()` waits for a pending save."""
    stock_save = trainer._save_checkpoint
    stock_finalize = trainer._finalize_training
    stock_save_weights = trainer._save

    def save_weights(output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # every rank enters `_save` (`save_model`); where no node holds every weight
        # (the split layout below fp32 compute) each takes part in the gather first
        accelerator = trainer.accelerator
        if state_dict is None and not getattr(trainer, "_lazytrain_weights_by_writer", False) \
                and getattr(accelerator, "lazytrain", None) is not None \
                and accelerator.lazytrain_gathers_weights():
            state_dict = accelerator.get_state_dict(trainer.model)
        return stock_save_weights(output_dir, state_dict)

    def save_checkpoint(model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        accelerator = trainer.accelerator
        if getattr(accelerator, "lazytrain", None) is not None:
            accelerator.lazytrain_settle_before_save()
        synchronous_because = _synchronous_because(trainer)
        if synchronous_because is None:
            return _save_beside_training(trainer, stock_save, model, trial, args, kwargs)
        start_s = time.perf_counter()
        if synchronous_because == SYNC_SETTING and accelerator.lazytrain_saves_with_writer():
            _save_beside_training(trainer, stock_save, model, trial, args, kwargs)
            accelerator.lazytrain_wait_for_checkpoint()
            logger.info("lazytrain: checkpoint written (sync, %.2f s: %s; the state homed on "
                        "NVMe copied from its files)", time.perf_counter() - start_s,
                        synchronous_because)
            return None
        lazytrain = getattr(accelerator, "lazytrain", None)
        with lazytrain.masters_in_dram() if lazytrain is not None else contextlib.nullcontext():
            final = _save_synchronously(trainer, stock_save, model, trial, args, kwargs)
        logger.info("lazytrain: checkpoint %s written (sync, %.2f s: %s)", final,
                    time.perf_counter() - start_s, synchronous_because)

    def finalize_training(*args: Any, **kwargs: Any) -> Any:
        # before the best model is loaded and the last rotation: the last save published
        if getattr(trainer.accelerator, "lazytrain", None) is not None:
            trainer.accelerator.lazytrain_wait_for_checkpoint()
        return stock_finalize(*args, **kwargs)

    trainer._save_checkpoint = save_checkpoint
    trainer._finalize_training = finalize_training
    trainer._save = save_weights
    remove_dead_staging(trainer.args.output_dir)


def _synchronous_because(trainer: Trainer) -> str | None:
    """Why this checkpoint is written synchronously; None: it is written beside training."""
    accelerator = trainer.accelerator
    if getattr(accelerator, "lazytrain", None) is None:
        return "no LazyTrain engine"
    if accelerator.lazytrain_plugin.checkpoint_mode != "async":
        return SYNC_SETTING
    if not accelerator.lazytrain_saves_async():
        return ("the update runs inline (optimizer='keep', overlap_step=False, or "
                "overlap_step='auto' on a CPU device), so no per-layer wait can order it "
                "after the save")
    if trainer.args.save_only_model:
        return "save_only_model"
    if not isinstance(trainer.model, PreTrainedModel):
        return f"a {type(trainer.model).__name__} is saved as the Trainer saves it"
    return None


def _save_synchronously(trainer: Trainer, stock_save: Any, model: Any, trial: Any,
                        args: tuple, kwargs: dict) -> Path:
    """The checkpoint, published before this returns; returns its folder."""
    lazytrain = getattr(trainer.accelerator, "lazytrain", None)
    if lazytrain is not None and lazytrain.store is not None:
        return _save_shared_checkpoint(trainer, stock_save, model, trial, *args, **kwargs)
    if trainer.args.world_size > 1:  # every rank writes its rng_state_<r>.pth
        return _save_from_every_rank(trainer, stock_save, model, trial, *args, **kwargs)
    run_dir = Path(trainer._get_output_dir(trial=trial))
    staging = run_dir / f"{STAGING_PREFIX}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with _redirected(trainer, staging):
            stock_save(model, trial, *args, **kwargs)
        (written,) = list(staging.iterdir())  # checkpoint-<global_step>
        fsync_tree(written)
        final = run_dir / written.name
        if final.exists():  # re-saving a step (e.g. after resume): replace it whole
            shutil.rmtree(final)
        written.rename(final)
        fsync_dir(run_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if trainer.state.best_model_checkpoint:
        trainer.state.best_model_checkpoint = trainer.state.best_model_checkpoint.replace(
            str(staging), str(run_dir))
    # The stock save rotated inside the staging folder (a no-op); rotate for real now.
    _rotate(trainer, run_dir)
    return final


def _save_beside_training(trainer: Trainer, stock_save: Any, model: Any, trial: Any,
                          args: tuple, kwargs: dict) -> None:
    """The asynchronous checkpoint (module docstring), on every rank at the same point:
    the stock files now, the weights and the optimizer state by the writer; rotation once
    published."""
    if trainer.args.world_size > 1:  # every rank names the same folder
        run_dir, final = _agreed_checkpoint_dir(trainer, trial)
    else:
        run_dir = Path(os.path.abspath(trainer._get_output_dir(trial=trial)))
        final = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"

    def write_stock(tmp: Path) -> None:  # at this step, before the writer starts
        with _weights_left_to_the_writer(trainer):
            _stock_save_into(tmp, trainer, stock_save, run_dir, model, trial, args, kwargs)
        _name_best(trainer, run_dir)

    trainer.accelerator.lazytrain_start_save(final, write_stock,
                                             on_published=lambda: _rotate(trainer, run_dir))


@contextlib.contextmanager
def _weights_left_to_the_writer(trainer: Trainer) -> Iterator[None]:
    """While the stock save runs: `save_pretrained` writes the model's config and
    generation config, not its weights, and `_save_optimizer_and_scheduler` the scheduler,
    not the optimizer state (`save_scheduler`); the asynchronous writer writes both."""
    model = trainer.model

    def save_pretrained(save_directory: str, *args: Any, is_main_process: bool = True,
                        **kwargs: Any) -> None:
        if not is_main_process:
            return
        os.makedirs(save_directory, exist_ok=True)
        # what the stock save_pretrained records in the config before writing it
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(save_directory)
        if model.can_generate():
            model.generation_config.save_pretrained(save_directory)

    model.save_pretrained = save_pretrained  # the instance only; the class's shows again
    trainer._lazytrain_saving_shares = trainer._lazytrain_weights_by_writer = True
    try:
        yield
    finally:
        trainer._lazytrain_saving_shares = trainer._lazytrain_weights_by_writer = False
        vars(model).pop("save_pretrained", None)


def _save_shared_checkpoint(trainer: Trainer, stock_save: Any, model: Any, trial: Any,
                            *args: Any, **kwargs: Any) -> Path:
    """The Trainer's checkpoint under the node store (module docstring), on every rank."""
    accelerator = trainer.accelerator
    run_dir, final = _agreed_checkpoint_dir(trainer, trial)

    def write_stock(tmp: Path) -> None:
        trainer._lazytrain_saving_shares = True
        try:
            _stock_save_into(tmp, trainer, stock_save, run_dir, model, trial, args, kwargs)
        finally:
            trainer._lazytrain_saving_shares = False
        if trainer.args.process_index == 0:  # save_model wrote them: every weight, none
            # de-duplicated away
            check_weights_complete(tmp, accelerator.lazytrain.model)

    share_checkpoint.save_shares(accelerator, final, write_stock, weights=False,
                                 optimizer_state=not trainer.args.save_only_model,
                                 label="Trainer._save_checkpoint")
    _name_best(trainer, run_dir)
    _rotate(trainer, run_dir)
    return final


def _save_from_every_rank(trainer: Trainer, stock_save: Any, model: Any, trial: Any,
                          *args: Any, **kwargs: Any) -> Path:
    """The Trainer's checkpoint of several replicated ranks (no node store): rank 0
    writes the weights, optimizer.pt, ...; every rank its rng_state_<r>.pth, all into one
    temporary directory that rank 0 publishes once every rank has written
    (`publication.save_on_every_rank`): no rank writes into a folder another
    replaces."""
    run_dir, final = _agreed_checkpoint_dir(trainer, trial)
    save_on_every_rank(
        final, lambda tmp: _stock_save_into(tmp, trainer, stock_save, run_dir, model, trial,
                                            args, kwargs),
        label="Trainer._save_checkpoint")
    _name_best(trainer, run_dir)
    _rotate(trainer, run_dir)
    return final


def _agreed_checkpoint_dir(trainer: Trainer, trial: Any) -> tuple[Path, Path]:
    """(the run dir, its checkpoint-<step>), checked to be the same on every rank."""
    import torch.distributed as dist

    run_dir = Path(os.path.abspath(trainer._get_output_dir(trial=trial)))
    final = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    named: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(named, str(final))
    if len(set(named)) > 1:
        raise RuntimeError("the ranks would save the Trainer's checkpoint to different "
                           f"folders ({', '.join(f'rank {r}: {n}' for r, n in enumerate(named))}"
                           "): give every rank the same output_dir and step")
    return run_dir, final


def _stock_save_into(tmp: Path, trainer: Trainer, stock_save: Any, run_dir: Path,
                     model: Any, trial: Any, args: tuple, kwargs: dict) -> None:
    """Run the stock save of this rank into a folder of its own inside `tmp`, then move
    what it wrote (inside its checkpoint-<global_step>; nothing when this rank had
    nothing to write) up into `tmp`."""
    staging = tmp / f"{STAGING_PREFIX}{trainer.args.process_index}"
    staging.mkdir()
    with _redirected(trainer, staging, final=run_dir):
        stock_save(model, trial, *args, **kwargs)
    for item in (i for folder in staging.iterdir() for i in folder.iterdir()):
        if (tmp / item.name).exists():
            raise RuntimeError(f"two ranks wrote {item.name} into the checkpoint")
        item.rename(tmp / item.name)
    shutil.rmtree(staging)


def _name_best(trainer: Trainer, run_dir: Path) -> None:
    """Name the best checkpoint in the run dir (stock named it inside the staging)."""
    if trainer.state.best_model_checkpoint:
        best = Path(trainer.state.best_model_checkpoint)
        trainer.state.best_model_checkpoint = str(run_dir / best.name)


def _rotate(trainer: Trainer, run_dir: Path) -> None:
    """The Trainer's rotation (`save_total_limit`, the best checkpoint kept), once the
    newest checkpoint is published (rank 0)."""
    if trainer.args.should_save:
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint,
                           use_mtime=True)


def save_scheduler(trainer: Trainer, output_dir: str) -> None:
    """`_save_optimizer_and_scheduler` under the node store or in an asynchronous save: the
    scheduler only (rank 0); the optimizer state goes to the share files. Outside the
    coordinated checkpoint save the shares would not be written: refused."""
    import warnings

    import torch
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_pt_utils import reissue_pt_warnings

    if not getattr(trainer, "_lazytrain_saving_shares", False):
        raise RuntimeError("under the node store each rank holds its share of the optimizer "
                           "state: it is saved by the Trainer's checkpoint save "
                           "(_save_checkpoint) or accelerator.save_state on every rank, not "
                           "by _save_optimizer_and_scheduler alone")
    if trainer.args.should_save:
        with warnings.catch_warnings(record=True) as caught:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir,
                                                                      SCHEDULER_NAME))
        reissue_pt_warnings(caught)


def load_shared_optimizer(trainer: Trainer, checkpoint: str) -> None:
    """`_load_optimizer_and_scheduler` of a share checkpoint (or of any checkpoint under
    the node store): this rank's share of the optimizer state, the scheduler."""
    import torch
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    accelerator = trainer.accelerator
    directory = Path(checkpoint)
    accelerator._lazytrain_synchronize()  # no update may write the state being loaded
    manifest = read_manifest(directory)
    share_checkpoint.load_optimizer_shares(accelerator, directory, manifest, OPTIMIZER_NAME)
    scheduler = directory / SCHEDULER_NAME
    if not scheduler.is_file():
        raise FileNotFoundError(f"{checkpoint} has no {SCHEDULER_NAME}: the learning rate "
                                "schedule cannot resume")
    trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class _redirected(logging.Filter):
    """While the stock save runs, its run dir is the staging folder; its log messages
    ("Saving model checkpoint to ...") name the folder the checkpoint ends up in."""

    def __init__(self, trainer: Trainer, staging: Path, final: Path | None = None) -> None:
        super().__init__()
        self._trainer, self._staging = trainer, staging
        self._final = str(final or staging.parent)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if str(self._staging) in message:
            record.msg, record.args = message.replace(str(self._staging), self._final), ()
        return True

    def __enter__(self) -> None:
        self._trainer._get_output_dir = lambda trial=None: str(self._staging)
        for name in _SAVE_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def __exit__(self, *exc: object) -> None:
        # Drop the instance attribute: the class's method shows through again.
        self._trainer.__dict__.pop("_get_output_dir", None)
        for name in _SAVE_LOGGERS:
            logging.getLogger(name).removeFilter(self)


def remove_dead_staging(output_dir: str | None) -> None:
    """Remove staging folders of saves whose process was killed, and what a killed
    asynchronous save left beside its checkpoint (`atomic.recover`)."""
    if not output_dir or not Path(output_dir).is_dir():
        return
    for folder in Path(output_dir).glob(f"{STAGING_PREFIX}*"):
        if folder.name != f"{STAGING_PREFIX}{os.getpid()}" and not owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
    for folder in Path(output_dir).glob(f".{PREFIX_CHECKPOINT_DIR}-*.*-*"):  # .<name>.tmp-<pid>
        recover(Path(output_dir) / folder.name[1:].split(".")[0])
