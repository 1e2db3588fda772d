"""Atomic Trainer checkpoints: `checkpoint-N` appears whole or not at all.

The Trainer writes `checkpoint-N` file by file into the output directory, so a process
killed mid-save leaves a partial folder that `resume_from_checkpoint=True` would pick as
the latest. Under LazyTrain each save goes to a staging folder beside it, is flushed to
the disk, then renamed into place (`integrations.checkpoint` flushes); checkpoint
rotation runs only after the rename, so an older checkpoint is never deleted before the
new one is complete.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import rotate_checkpoints

from lazytrain_accel.integrations.checkpoint import fsync_dir, fsync_tree, owner_alive

STAGING_PREFIX = ".lazytrain-staging-"
#: Loggers whose messages name the folder a checkpoint is being written to.
_SAVE_LOGGERS = ("transformers.trainer", "transformers.modeling_utils",
                 "transformers.configuration_utils", "transformers.tokenization_utils_base",
                 "transformers.generation.configuration_utils")


def make_checkpoints_atomic(trainer: Trainer) -> None:
    """Route this Trainer instance's `_save_checkpoint` through a staging folder."""
    stock_save = trainer._save_checkpoint

    def save_checkpoint(model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        run_dir = Path(trainer._get_output_dir(trial=trial))
        if not trainer.args.should_save:  # other ranks write nothing of their own
            return stock_save(model, trial, *args, **kwargs)
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
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint,
                           use_mtime=True)

    trainer._save_checkpoint = save_checkpoint
    remove_dead_staging(trainer.args.output_dir)


class _redirected(logging.Filter):
    """While the stock save runs, its run dir is the staging folder; its log messages
    ("Saving model checkpoint to ...") name the folder the checkpoint ends up in."""

    def __init__(self, trainer: Trainer, staging: Path) -> None:
        super().__init__()
        self._trainer, self._staging = trainer, staging
        self._final = str(staging.parent)

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
    """Remove staging folders of saves whose process was killed."""
    if not output_dir or not Path(output_dir).is_dir():
        return
    for folder in Path(output_dir).glob(f"{STAGING_PREFIX}*"):
        if folder.name != f"{STAGING_PREFIX}{os.getpid()}" and not owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
