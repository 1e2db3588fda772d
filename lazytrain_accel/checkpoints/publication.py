"""Publishing a checkpoint that every rank writes into: whole, or not at all.

Rank 0 opens `atomic.atomic_directory` and names its temporary directory to every rank
(`open_on_every_rank`); each rank writes its part and reports ("ok" or its error) through
an all-gather (`gather_reports`); rank 0 finishes (the manifest, last), renames the
directory into place and a broadcast tells every rank the outcome (`save_on_every_rank`).
Any rank's failure is raised on every rank and the previous checkpoint is kept.
`my_share` is which update groups' share each rank writes. The asynchronous save
(`asynchronous.py`) publishes through marks in the directory instead.
Design: docs/architecture.md "Checkpoints beside training" ("Publication").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel.checkpoints.atomic import atomic_directory

if TYPE_CHECKING:
    from lazytrain_accel.engine import StreamingEngine


def rank_and_world() -> tuple[int, int]:
    """This process's global rank and the world size ((0, 1) without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_world_size(world: int) -> int:
    """How many ranks share this node (the launcher's `LOCAL_WORLD_SIZE`; `world` without
    one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def my_share(engine: StreamingEngine | None, optimizer: torch.optim.Optimizer | None, *,
             rank: int, world: int) -> tuple[list[int], list[nn.Parameter]]:
    """The groups whose share this rank writes, and their parameters: under a split
    update the groups it owns (those every rank owns: rank 0) and, split across nodes,
    updates; without one, rank 0 every parameter of the optimizer (the same on every
    rank), the others none."""
    groups = engine.steps.update_groups if engine is not None else []
    peers = engine.steps.peers if engine is not None else None
    if peers is None:
        if rank != 0 or optimizer is None:
            return [], []
        return (list(range(len(groups))),
                [p for g in optimizer.param_groups for p in g["params"]])
    remote = engine.steps.remote  # the split layout: a group is written where updated
    owned = [g for g in range(len(groups))
             if peers.owns(g) and (remote is None or not remote.is_remote(g))]
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, owned)
    shared_by_all = set.intersection(*(set(o) for o in everyone))
    mine = [g for g in owned if g not in shared_by_all or rank == 0]  # written once
    return mine, [p for g in mine for p in groups[g]]


def save_on_every_rank(final: Path, write: Callable[[Path], Any], *,
                       finish: Callable[[Path, list[Any]], None] | None = None,
                       label: str) -> None:
    """A checkpoint folder every rank writes into, published whole or not at all: rank 0
    opens `atomic_directory(final)` and names its temporary directory to all, every rank
    runs `write(tmp)` (its result: this rank's report), rank 0 runs `finish(tmp,
    reports)` and renames the directory into place once every rank has written. Any
    rank's failure is raised on every rank, `final` (a previous checkpoint) untouched.
    Every rank calls it at the same point; `label` names the save in errors."""
    if not (dist.is_available() and dist.is_initialized()):  # one process
        with atomic_directory(final) as tmp:
            report = write(tmp)
            if finish is not None:
                finish(tmp, [report])
        return
    tmp, stack = open_on_every_rank(final, label=label)
    try:
        report: tuple[str, Any] = ("ok", write(tmp))
    except Exception as err:  # reported to rank 0, raised on every rank
        report = ("error", describe_error(err))
    reports = gather_reports(report, stack, final=final, label=label)
    outcome: list[str | None] = [None]
    if stack is not None:
        try:
            if finish is not None:
                finish(tmp, reports)
            stack.close()  # fsync, rename into place: the checkpoint exists from here
        except BaseException as err:  # the temporary directory goes
            abandon(stack, err)
            outcome[0] = describe_error(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RuntimeError(f"{label}({final}) failed, the previous checkpoint (if any) "
                           f"is kept: {outcome[0]}")


def open_on_every_rank(final: Path, *, label: str
                       ) -> tuple[Path, contextlib.ExitStack | None]:
    """Rank 0 opens `atomic_directory(final)` and names its temporary directory to every
    rank (all call it at the same point); returns it, and on rank 0 the stack whose
    `close()` publishes it (None on the others). A failure to open is raised on every
    rank."""
    rank, _ = rank_and_world()
    stack = contextlib.ExitStack()
    if not (dist.is_available() and dist.is_initialized()):  # one process
        return stack.enter_context(atomic_directory(final)), stack
    opened: list[str | None] = [None, None]
    if rank == 0:
        try:
            opened[0] = str(stack.enter_context(atomic_directory(final)))
        except Exception as err:  # every rank must hear of it
            opened[1] = describe_error(err)
    dist.broadcast_object_list(opened, src=0)
    if opened[1] is not None:
        raise RuntimeError(f"{label}({final}): rank 0 could not open the checkpoint's "
                           f"temporary directory: {opened[1]}")
    return Path(opened[0]), stack if rank == 0 else None


def gather_reports(report: tuple[str, Any], stack: contextlib.ExitStack | None, *,
                   final: Path, label: str) -> list[Any]:
    """Every rank's `("ok", value)` or `("error", message)`, on every rank; the values
    when all are "ok". Otherwise rank 0 removes the temporary directory (`stack`) and
    every rank raises the failures, `final` untouched."""
    if dist.is_available() and dist.is_initialized():
        reports: list[tuple[str, Any] | None] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(reports, report)
        except BaseException as err:  # a rank died mid-save: no temporary directory left
            if stack is not None:
                abandon(stack, err)
            raise
    else:
        reports = [report]
    failed = {r: msg for r, (kind, msg) in enumerate(reports) if kind == "error"}
    if failed:
        err = RuntimeError("; ".join(f"rank {r}: {m}" for r, m in failed.items()))
        if stack is not None:
            abandon(stack, err)
        raise RuntimeError(f"{label}({final}) failed, the previous checkpoint (if any) "
                           f"is kept: {err}")
    return [value for _, value in reports]


def abandon(stack: contextlib.ExitStack, err: BaseException) -> None:
    """Close `atomic_directory` with `err`: its temporary directory is removed."""
    with contextlib.suppress(BaseException):
        stack.__exit__(type(err), err, err.__traceback__)


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
