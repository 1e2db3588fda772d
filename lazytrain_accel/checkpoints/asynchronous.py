"""Checkpoints written beside training, from the masters themselves (`checkpoint_mode="async"`).

`save_state` writes what is small at the save's step on every rank (stock state, headers,
`config.json`, the index, the manifest's content), starts one writer thread per rank and
returns. A writer walks the update groups its own rank's update changes (0: input
residents, j: layer j, L+1: output residents, then the tensors no update writes) and
writes them straight from the tensors. Invariant: the next update of group g waits at g's
gate (`StepCoordinator.save_gate`) until g's bytes are out of the tensors, so the
checkpoint holds step k exactly and no copy of the state is made (state homed on NVMe is
copied from its layer's file, file to file). Publication is the
atomic directory of `publication.py`, rank 0 renaming once every rank's mark is there.
Design: docs/architecture.md "Checkpoints beside training"; docs/user_guide.md "8. Checkpoints".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lazytrain_accel.checkpoints import direct, layout
from lazytrain_accel.checkpoints import publication as pub
from lazytrain_accel.checkpoints import share_format as fmt
from lazytrain_accel.storage.direct_io import FileRange

if TYPE_CHECKING:
    from lazytrain_accel.config import LazyTrainConfig
    from lazytrain_accel.engine import StreamingEngine

logger = logging.getLogger("lazytrain_accel")

#: Bytes written per `write(2)` (and per throttle check): large enough for full-speed
#: sequential writes, small enough that a throttled writer paces smoothly.
_CHUNK_BYTES = 16 << 20
#: How often rank 0 looks for the other ranks' marks, and they for the publication.
_POLL_S = 0.02


class SavedRun(Protocol):
    """What a checkpoint reads of the run (`run/state.py:RunState`)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def engine(self) -> StreamingEngine | None: ...


class CheckpointedAccelerator(Protocol):
    """What a share checkpoint's save and load read of the LazyTrain Accelerator
    (`frontends/accelerate.py`, a layer above): the run, the plugin's checkpoint settings
    (`checkpoint_dtype`, `checkpoint_max_shard_bytes`, `checkpoint_write_bytes_per_s`)
    and the step."""

    @property
    def lazytrain(self) -> SavedRun | None: ...

    @property
    def lazytrain_plugin(self) -> LazyTrainConfig | None: ...

    @property
    def step(self) -> int: ...


@dataclass(kw_only=True, frozen=True)
class _Entry:
    """One tensor to append to one file, after the tensors of earlier groups."""

    group: int
    file: int
    tensor: torch.Tensor
    dtype: torch.dtype | None  # the export dtype of the weights; None: as held
    #: (parameter, state name or None for its master) where its values live in the
    #: layer's file on NVMe (`tensor` a placeholder): read by the writer, one layer at a
    #: time (`NvmeMasters.read_values`)
    source: tuple[nn.Parameter, str | None] | None = None


class PendingSave:
    """A checkpoint being written by this rank's thread; `wait_written(g)` until group g
    is. `stack` (rank 0's temporary directory) and `manifest` are rank 0's; None on the
    other ranks, which only write their files and mark them."""

    def __init__(self, *, final: Path, tmp: Path, rank: int, world: int, groups: int,
                 files: Sequence[tuple[Path, bytes]], entries: Sequence[_Entry],
                 stack: contextlib.ExitStack | None, manifest: dict[str, Any] | None,
                 write_bytes_per_s: float, on_published: Callable[[], None],
                 read_layer: Callable[[int], Mapping[tuple[nn.Parameter, str | None],
                                                     torch.Tensor]] | None = None,
                 file_range: Callable[[nn.Parameter, str | None], FileRange | None]
                 | None = None) -> None:
        self.final = final
        self._stack, self._tmp, self._tmp_inode = stack, tmp, tmp.stat().st_ino
        self._rank, self._world = rank, world
        self._files, self._entries, self._manifest = files, entries, manifest
        self._rate = write_bytes_per_s
        self._on_published = on_published
        self._read_layer = read_layer
        self._file_range = file_range
        self._written = [threading.Event() for _ in range(groups)]
        for g in set(range(groups)) - {e.group for e in entries}:
            self._written[g].set()  # this rank writes nothing of g: its update never waits
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.update_waited_s = 0.0
        self.written_bytes = 0
        self.copied_bytes = 0  # of them, copied file to file from the state on NVMe
        self.duration_s: float | None = None  # from start to publication
        #: The writer's own: wall seconds until every group was written (out of the
        #: tensors), then fsyncing the files, and the CPU seconds its thread used.
        self.write_s = self.fsync_s = self.writer_cpu_s = 0.0
        self._start_s = time.perf_counter()
        # Not a daemon: an interpreter exiting right after save_state finishes the save.
        self._thread = threading.Thread(target=self._run, name="lazytrain-checkpoint")
        self._thread.start()

    # ---- the training side ------------------------------------------------------------
    def wait_written(self, group: int) -> None:
        """Block until group `group` is written to its files (the kernel holds the bytes;
        the update may change the tensors), or the save has ended."""
        if self._written[group].is_set():
            return
        start = time.perf_counter()
        self._written[group].wait()
        with self._lock:
            self.update_waited_s += time.perf_counter() - start

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save has ended (published, on every rank); raise if it failed
        (the previous checkpoint is kept)."""
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the checkpoint save to {self.final} failed, the previous "
                               f"checkpoint (if any) is kept: {type(err).__name__}: {err}"
                               ) from err

    # ---- the writer thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            staging = direct.Staging()
            with contextlib.ExitStack() as files:
                handles = [files.enter_context(direct.DirectFile(path, staging))
                           for path, _ in self._files]
                for f, (_, header) in zip(handles, self._files, strict=True):
                    f.write(header)
                self._write_groups(handles)
                for f in handles:
                    f.finish()
                self.write_s = time.perf_counter() - self._start_s
                for f in handles:
                    f.fsync()
                self.fsync_s = time.perf_counter() - self._start_s - self.write_s
            if self._stack is None:  # not rank 0: mark, then wait for rank 0's rename
                _mark(self._tmp / f".written-{self._rank}", "")
                self._wait_published()
            else:
                self._wait_for_ranks()
                (self._tmp / fmt.MANIFEST).write_text(json.dumps(self._manifest, indent=1))
                self._stack.close()  # fsync, rename into place: the checkpoint exists now
        except BaseException as err:  # raised on the training thread by wait()
            self._error = err
            if self._stack is not None:
                pub.abandon(self._stack, err)
            else:
                with contextlib.suppress(OSError):  # rank 0 may have abandoned already
                    _mark(self._tmp / f".failed-{self._rank}", f"{type(err).__name__}: {err}")
        finally:
            for event in self._written:
                event.set()  # training goes on, whatever happened here
            self.writer_cpu_s = time.thread_time()
        if self._error is None:
            self._published()

    def _write_groups(self, handles: Sequence[direct.DirectFile]) -> None:
        opened = 0  # the gates of the groups before this one are open
        read: tuple[int, Mapping[tuple[nn.Parameter, str | None], torch.Tensor]] = (-1, {})
        for entry in self._entries:
            for g in range(opened, min(entry.group, len(self._written))):
                self._written[g].set()
            opened = max(opened, entry.group)
            tensor = entry.tensor
            if entry.source is not None and self._copy(handles[entry.file], entry):
                continue
            if entry.source is not None:  # its layer's file, read once (one layer's DRAM)
                if read[0] != entry.group:
                    read = (entry.group, self._read_layer(entry.group))
                tensor = read[1][entry.source]
            self._write(handles[entry.file], tensor, entry.dtype)
        for event in self._written:  # every byte is out of the tensors (staged or written)
            event.set()

    def _copy(self, f: direct.DirectFile, entry: _Entry) -> bool:
        """Append `entry`'s bytes from its layer's file on NVMe, file to file
        (`DirectFile.copy_from`), where they are the bytes the checkpoint holds; False
        where not (a cast to the export dtype: read through DRAM instead)."""
        where = None if self._file_range is None else self._file_range(*entry.source)
        if where is None or where.dtype != layout.export_dtype(entry.tensor, entry.dtype):
            return False
        source = os.open(where.path, os.O_RDONLY)
        try:
            for start in range(0, where.nbytes, _CHUNK_BYTES):
                n = f.copy_from(source, where.offset_bytes + start,
                                min(_CHUNK_BYTES, where.nbytes - start))
                self.copied_bytes += n
                self._count(n)
        finally:
            os.close(source)
        return True

    def _write(self, f: direct.DirectFile, tensor: torch.Tensor, dtype: torch.dtype | None
               ) -> None:
        data = layout.tensor_bytes(tensor, dtype)
        for start in range(0, len(data), _CHUNK_BYTES):
            chunk = data[start:start + _CHUNK_BYTES]
            f.write(chunk)
            self._count(len(chunk))

    def _count(self, nbytes: int) -> None:
        """`nbytes` more written; a throttled writer (setting) keeps to its rate."""
        self.written_bytes += nbytes
        if self._rate > 0:
            ahead_s = self.written_bytes / self._rate - (time.perf_counter() - self._start_s)
            if ahead_s > 0:
                time.sleep(ahead_s)

    def _wait_for_ranks(self) -> None:
        """Rank 0: until every other rank has marked its files written; raise the first
        failure marked. The marks are removed: the checkpoint holds none."""
        pending = set(range(1, self._world))
        while pending:
            for rank in sorted(pending):
                failed = self._tmp / f".failed-{rank}"
                if failed.exists():
                    raise RuntimeError(f"rank {rank}: {failed.read_text()}")
                if (self._tmp / f".written-{rank}").exists():
                    pending.discard(rank)
            if pending:
                time.sleep(_POLL_S)
        for rank in range(1, self._world):
            (self._tmp / f".written-{rank}").unlink()

    def _wait_published(self) -> None:
        """Another rank: until rank 0 has renamed the temporary directory into place or
        removed it; raise in the second case."""
        while self._tmp.exists():
            time.sleep(_POLL_S)
        with contextlib.suppress(FileNotFoundError):
            if self.final.stat().st_ino == self._tmp_inode:
                return
        raise RuntimeError("rank 0 did not publish the checkpoint (its error is raised "
                           "on rank 0)")

    def _published(self) -> None:
        duration_s = self.duration_s = time.perf_counter() - self._start_s
        if self._stack is None:
            return  # rank 0 logs the save and rotates
        logger.info("lazytrain: checkpoint %s written (async, %.2f s, %.3f GB at %.0f MB/s "
                    "from rank 0: written in %.2f s, fsynced in %.2f s, the writer's CPU "
                    "%.2f s; the update waited %.2f s for it)", self.final, duration_s,
                    self.written_bytes / 1e9, self.written_bytes / 1e6 / max(duration_s, 1e-9),
                    self.write_s, self.fsync_s, self.writer_cpu_s, self.update_waited_s)
        try:
            self._on_published()
        except Exception as err:  # the checkpoint exists; rotation is best effort
            logger.warning("lazytrain: rotating old checkpoints after %s failed: %s",
                           self.final, err)


def _mark(path: Path, text: str) -> None:
    """A small file, on the disk before this returns (what another rank polls for)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def group_order(named: Sequence[tuple[str, torch.Tensor]],
                groups: Sequence[Sequence[nn.Parameter]]
                ) -> list[tuple[int, str, torch.Tensor]]:
    """`named` sorted by the update group that writes each tensor (stable; tensors no
    update writes, such as frozen weights and buffers, after the last group)."""
    group_of = {id(p): g for g, params in enumerate(groups) for p in params}
    tagged = [(group_of.get(id(t), len(groups)), name, t) for name, t in named]
    return sorted(tagged, key=lambda item: item[0])


@dataclass(kw_only=True, frozen=True)
class _Part:
    """What this rank writes: its weight shards (named once every rank's count is known)
    and its share file's header (None: no share file) and tensors, and the share's
    manifest record."""

    shards: list[list[tuple[int, str, torch.Tensor]]]  # (group, name, tensor), group order
    share_header: bytes | None
    share_tensors: list[tuple[int, torch.Tensor]]  # (group, tensor), group order
    share_record: dict[str, Any]
    #: id of a tensor above -> where its values live on NVMe (`_Entry.source`)
    sources: dict[int, tuple[nn.Parameter, str | None]]


def start_save(accelerator: CheckpointedAccelerator, final: Path,
               write_stock: Callable[[Path], None], *,
               on_published: Callable[[], None]) -> PendingSave:
    """On every rank at the same point, after the step's update: open the checkpoint's
    temporary directory (rank 0, named to all), write the small files now and start this
    rank's writer of the rest (module docstring). Any rank's failure here is raised on
    every rank, the previous checkpoint untouched."""
    rank, world = pub.rank_and_world()
    local = pub.local_world_size(world)  # one node writes the weights (split: each its own)
    model, optimizer = accelerator.lazytrain.model, accelerator.lazytrain.optimizer
    plugin, engine = accelerator.lazytrain_plugin, accelerator.lazytrain.engine
    groups = engine.steps.update_groups
    dtype = layout.CHECKPOINT_DTYPES[plugin.checkpoint_dtype]
    mine, params = pub.my_share(engine, optimizer, rank=rank, world=world)
    tmp, stack = pub.open_on_every_rank(final, label="save_state")
    part: _Part | None = None
    try:
        write_stock(tmp)  # scheduler, RNG, samplers, the plan: at this step
        split = engine.steps.remote is not None  # a group's weights where it is updated
        weight_groups = set(mine) if rank < local or split else set()
        if rank == 0:
            weight_groups.add(len(groups))  # and rank 0 the tensors no update writes
        part = _part(model, optimizer, groups, weight_groups, mine, params, dtype,
                     max_shard_bytes=plugin.checkpoint_max_shard_bytes, rank=rank,
                     in_files=_in_files(engine))
        sizes = [[(n, layout.exported_bytes(t, dtype)) for _, n, t in shard]
                 for shard in part.shards]
        report: tuple[str, Any] = ("ok", (sizes, part.share_record))
    except BaseException as err:  # reported to rank 0, raised on every rank
        if world == 1 or not isinstance(err, Exception):
            if stack is not None:
                pub.abandon(stack, err)
            raise
        report = ("error", pub.describe_error(err))
    reports = pub.gather_reports(report, stack, final=final, label="save_state")
    assert part is not None  # every rank reported "ok"
    try:
        files, entries = _files(tmp, part, [sizes for sizes, _ in reports], rank=rank,
                                dtype=dtype)
        manifest = None
        if stack is not None:
            fmt.write_config(tmp, model)
            manifest = fmt.run_manifest(model, optimizer, [record for _, record in reports],
                                        step=int(accelerator.step), world_size=world,
                                        local_world_size=local)
    except BaseException as err:
        if stack is not None:
            pub.abandon(stack, err)
        raise
    return PendingSave(final=final, tmp=tmp, rank=rank, world=world, groups=len(groups),
                       files=files, entries=entries, stack=stack, manifest=manifest,
                       write_bytes_per_s=plugin.checkpoint_write_bytes_per_s,
                       on_published=on_published, read_layer=engine.masters.read_values,
                       file_range=engine.masters.file_range)


def _part(model: nn.Module, optimizer: torch.optim.Optimizer,
          groups: Sequence[Sequence[nn.Parameter]], weight_groups: set[int],
          mine: Sequence[int], params: Sequence[nn.Parameter], dtype: torch.dtype | None, *,
          max_shard_bytes: int, rank: int,
          in_files: Callable[[nn.Parameter, str], tuple[nn.Parameter, str | None] | None]
          ) -> _Part:
    """This rank's weights (the tensors of `weight_groups`, cut into shards) and its share
    of the optimizer state (`params`, the groups `mine`), each in group order."""
    # Each tensor as it is now, the masters (no layer runs between steps), not the
    # parameter: a layer the next forward runs while the writer reaches it points its
    # `.data` at a weight slot the pool refills with other layers (a torn tensor on a CPU,
    # the compute-dtype copy on a GPU).
    weights = [item for item in group_order(fmt.unique_state(model), groups)
               if item[0] in weight_groups]
    ordered = [(g, name, t.detach()) for g, name, t in weights]
    # a tensor whose values live in its layer's file on NVMe: the writer reads them there
    sources = {id(held): where for (_, name, t), (_, _, held) in zip(weights, ordered,
                                                                     strict=True)
               if (where := in_files(t, name)) is not None}
    by_name = {name: (g, name, t) for g, name, t in ordered}
    shards = [[by_name[name] for name, _ in shard] for shard in layout.plan_shards(
        [(n, t) for _, n, t in ordered], max_shard_bytes=max_shard_bytes, dtype=dtype)
        if shard]
    header, tensors, written = None, [], []
    if params:
        group_of = {id(p): g for g, ps in enumerate(groups) for p in ps}
        in_order = sorted(params, key=lambda p: group_of.get(id(p), len(groups)))
        named, metadata, written = fmt.share_tensors(optimizer, in_order, fmt.param_names(model),
                                                    weights_dtype=dtype)
        header = layout.safetensors_header([(key, t) for key, t, _ in named],
                                           metadata=metadata)
        tensors = [(group_of.get(id(p), len(groups)), t) for _, t, p in named]
        sources |= {id(t): where for key, t, p in named
                    if (where := in_files(p, key)) is not None}
    return _Part(shards=shards, share_header=header, share_tensors=tensors,
                 share_record=fmt.share_record(rank=rank, mine=mine, optimizer=optimizer,
                                              params=params, written=written),
                 sources=sources)


def _in_files(engine: StreamingEngine) -> Callable[[nn.Parameter, str], tuple[
        nn.Parameter, str | None] | None]:
    """Where a tensor of the save lives in a layer's file on NVMe: given its parameter and
    its share key (`<name>/<state key>`, or its weight name), the `_Entry.source` (None:
    the tensor holds its values)."""
    def source(param: nn.Parameter, key: str) -> tuple[nn.Parameter, str | None] | None:
        name = key.rsplit("/", 1)[1] if "/" in key else fmt.MASTER_KEY
        state_name = None if name == fmt.MASTER_KEY else name
        in_file = isinstance(param, nn.Parameter) and engine.masters.in_file(param, state_name)
        return (param, state_name) if in_file else None

    return source


def _files(tmp: Path, part: _Part, sizes: Sequence[Sequence[Sequence[tuple[str, int]]]], *,
           rank: int, dtype: torch.dtype | None
           ) -> tuple[list[tuple[Path, bytes]], list[_Entry]]:
    """This rank's files (path, header) and its entries in group order, once every rank's
    shard count is known (`sizes`: each rank's shards as (name, bytes)): the shards are
    numbered across the ranks in rank order, one `model.safetensors` when there is one;
    rank 0 writes the index of several."""
    counts = [len(shards) for shards in sizes]
    total, first = sum(counts), sum(counts[:rank])
    names = ([layout.WEIGHTS] if total == 1 else
             [layout.shard_file(i + 1, total) for i in range(total)])
    if rank == 0 and total > 1:
        layout.write_index(tmp, names, [shard for shards in sizes for shard in shards])
    files, entries = [], []
    for index, shard in enumerate(part.shards):
        files.append((tmp / names[first + index], layout.safetensors_header(
            [(n, t) for _, n, t in shard], dtype=dtype)))
        entries += [_Entry(group=g, file=index, tensor=t, dtype=dtype,
                           source=part.sources.get(id(t))) for g, _, t in shard]
    if part.share_header is not None:
        files.append((tmp / part.share_record["file"], part.share_header))
        entries += [_Entry(group=g, file=len(files) - 1, tensor=t, dtype=None,
                           source=part.sources.get(id(t))) for g, t in part.share_tensors]
    return files, sorted(entries, key=lambda e: e.group)
