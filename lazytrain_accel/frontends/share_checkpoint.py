"""A share checkpoint as the Accelerator saves and loads it: accelerate's glue.

Where `save_state` writes (`target_directory`; with automatic naming the next
`checkpoint_<i>`, the oldest beyond `total_limit` removed once the new one is published:
`rotate`), what `load_state()` without a folder resumes from (`latest_directory`), the
streamed model and its optimizer hidden from accelerate's stock save and load (`hidden`),
and the blocking share save and the loads of a run (`save_shares`, `load_shares`,
`load_optimizer_shares`) on top of `checkpoints/` (format, publication, resume).
Docs: docs/user_guide.md "8. Checkpoints"; docs/architecture.md "Checkpoints beside
training".
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import accelerate
import torch
from torch import nn

from lazytrain_accel.checkpoints.asynchronous import CheckpointedAccelerator
from lazytrain_accel.checkpoints.atomic import remove_directory
from lazytrain_accel.checkpoints.layout import CHECKPOINT_DTYPES
from lazytrain_accel.checkpoints.publication import (
    local_world_size,
    my_share,
    rank_and_world,
    save_on_every_rank,
)
from lazytrain_accel.checkpoints.resume import load_share_checkpoint
from lazytrain_accel.checkpoints.share_format import MANIFEST, run_manifest, write_rank_files


def target_directory(accelerator: accelerate.Accelerator, output_dir: str | None) -> Path:
    """Where `save_state(output_dir)` writes: `output_dir`, or with accelerate's
    automatic checkpoint naming `<project_dir>/checkpoints/checkpoint_<i>` (the oldest
    beyond `total_limit` go once it is published: `rotate`)."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state() needs an output_dir (or a ProjectConfiguration "
                             "with automatic_checkpoint_naming=True)")
        return Path(output_dir)
    final = Path(accelerator.project_dir) / "checkpoints" / (
        f"checkpoint_{accelerator.save_iteration}")
    if final.exists():
        raise ValueError(f"Checkpoint directory {final} ({accelerator.save_iteration}) "
                         "already exists; set `save_iteration` to the iteration to start "
                         "with")
    return final


def rotate(accelerator: accelerate.Accelerator, final: Path) -> None:
    """After `final` is published, with automatic naming: remove the oldest checkpoints
    beyond `total_limit` (the main process), as stock does before its save; never before
    the new one is complete."""
    config = accelerator.project_configuration
    if (not config.automatic_checkpoint_naming or config.total_limit is None
            or not accelerator.is_main_process):
        return
    folders = _numbered(final.parent)
    for folder in folders[:max(0, len(folders) - config.total_limit)]:
        remove_directory(folder)  # never half a checkpoint under its name


def latest_directory(accelerator: accelerate.Accelerator) -> Path:
    """What `load_state()` without a folder resumes from under automatic naming: the
    highest `<project_dir>/checkpoints/checkpoint_<i>`. Only a published checkpoint has
    that name; stock accelerate takes the first number in any entry's name, so it would
    take a killed save's `.checkpoint_<i+1>.tmp-<pid>` for the latest."""
    parent = Path(accelerator.project_dir) / "checkpoints"
    folders = _numbered(parent) if parent.is_dir() else []
    if not folders:
        raise FileNotFoundError(f"load_state() found no checkpoint_<i> folder in {parent} "
                                "to resume from: pass the folder to load, or save first")
    return folders[-1]


def _numbered(parent: Path) -> list[Path]:
    """The `checkpoint_<i>` folders of `parent`, by i."""
    return sorted((f for f in parent.iterdir() if f.name.startswith("checkpoint_")
                   and f.name.rsplit("_", 1)[-1].isdigit()),
                  key=lambda f: int(f.name.rsplit("_", 1)[-1]))


@contextlib.contextmanager
def hidden(accelerator: accelerate.Accelerator, model: nn.Module,
           optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Hide the streamed model and its optimizer from accelerate's stock save/load (which
    still handles the schedulers, samplers, RNG states, scaler and custom objects), and
    its automatic checkpoint naming (the directory is chosen: `target_directory`)."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in models if m is not model]
    accelerator._optimizers = [o for o in optimizers
                               if getattr(o, "optimizer", o) is not optimizer]
    try:
        with _no_automatic_naming(accelerator):  # the caller chose the directory
            yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


@contextlib.contextmanager
def _no_automatic_naming(accelerator: accelerate.Accelerator) -> Iterator[None]:
    config = accelerator.project_configuration
    automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = automatic


def save_shares(accelerator: CheckpointedAccelerator, final: Path,
                write_stock: Callable[[Path], None], *, weights: bool = True,
                optimizer_state: bool = True, label: str = "save_state") -> None:
    """Write the checkpoint at `final` from every rank (`save_on_every_rank`); every rank
    calls it at the same point, after the step's update. Without a split update (one
    process, or replicated ranks) rank 0 writes the one share. `weights=False`:
    `write_stock` writes the weights (the Trainer's `save_model`);
    `optimizer_state=False`: no share files (the Trainer's `save_only_model`); `label`
    names the save in errors."""
    state, plugin = accelerator.lazytrain, accelerator.lazytrain_plugin
    rank, world = rank_and_world()
    optimizer = state.optimizer if optimizer_state else None
    mine, params = my_share(state.engine, optimizer, rank=rank, world=world)

    def write(tmp: Path) -> dict[str, Any]:  # this rank's files, then the stock ones
        dtype = CHECKPOINT_DTYPES[plugin.checkpoint_dtype] if weights else None
        record = write_rank_files(tmp, state.model, optimizer, rank=rank, mine=mine,
                                  params=params, weights=weights, dtype=dtype,
                                  max_shard_bytes=plugin.checkpoint_max_shard_bytes)
        write_stock(tmp)
        return record

    def finish(tmp: Path, shares: list[Any]) -> None:
        manifest = run_manifest(state.model, optimizer, shares, step=int(accelerator.step),
                                world_size=world, local_world_size=local_world_size(world))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))

    save_on_every_rank(final, write, finish=finish, label=label)


def load_shares(accelerator: CheckpointedAccelerator, directory: Path,
                manifest: Mapping[str, Any] | None) -> None:
    """Load the masters and the optimizer state this rank owns from a share checkpoint
    (`manifest`), or from a stock one (None: `model.safetensors`, `optimizer.bin`)."""
    state = accelerator.lazytrain
    load_share_checkpoint(directory, manifest, model=state.model, optimizer=state.optimizer,
                          engine=state.engine, weights=True)


def load_optimizer_shares(accelerator: CheckpointedAccelerator, directory: Path,
                          manifest: Mapping[str, Any] | None, stock_file: str) -> None:
    """The optimizer state this rank owns (all of it without a split update) from a
    share checkpoint (`manifest`) or, None, from the one-process state dict `stock_file`
    (the Trainer's `optimizer.pt`); the weights are loaded elsewhere (the Trainer loads
    them before `prepare`). What cannot load is refused, never skipped."""
    state = accelerator.lazytrain
    load_share_checkpoint(directory, manifest, model=state.model, optimizer=state.optimizer,
                          engine=state.engine, weights=False, stock_optimizer=stock_file,
                          require_optimizer=True)
