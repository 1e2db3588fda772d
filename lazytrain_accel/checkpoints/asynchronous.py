"""A checkpoint written beside training, from the masters themselves (issue 33 items 1,
2 and 4).

`save_state` (one process, the layer-wise update on) captures what is small at the
save's step, synchronously: the stock state (scheduler, RNG, samplers, the plan), the
manifest's content, `config.json` and the weights' index. It then starts one writer
thread and returns. The writer walks the update groups in order (0: input residents,
j: layer j, L+1: output residents, then tensors no update writes), and for each group
appends its weights to the shard files and its optimizer state (and masters, under an
export dtype) to the share file, straight from the tensors the optimizer updates; then it
opens the group's gate. The next update of group g first waits at that gate
(`StepCoordinator.save_gate`, `LayerwiseUpdate(before_group=)`): the only writer of g's
bytes waits until g is on the disk, so nothing is copied and the checkpoint holds step k
exactly. The forward of step k+1 reads masters, never writes them, so it runs freely.

One writer thread on purpose: its work is `write(2)` of bytes that are already in memory
(the GIL released, the core idle while the disk takes them), and one sequential stream
per file is what a disk writes fastest; a second writer would compete with the update
thread for the 2 of cores `threads.py` sized the pools for.

The atomic protocol is `share_checkpoint`'s: a temporary directory beside the target,
every file fsynced, the manifest written last, the rename, then rotation. A kill at any
moment leaves the previous checkpoint and a `.tmp-<pid>` directory that `recover`
removes; a writer error removes the temporary directory, opens every gate (training goes
on) and is raised by the next save, `load_state` or `end_training`.

Memory: what the writer holds beyond the state is one tensor, copied alone to cast it to
the export dtype or to read it off the device (none in the model's dtype on the host),
below one group's bytes; `preflight.py` `save_buffer_bytes` counts it in the host check.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from lazytrain_accel.checkpoints import layout as layout
from lazytrain_accel.checkpoints import shares as sc

logger = logging.getLogger("lazytrain_accel")

#: Bytes written per `write(2)` (and per throttle check): large enough for full-speed
#: sequential writes, small enough that a throttled writer paces smoothly.
_CHUNK_BYTES = 16 << 20


@dataclass(kw_only=True, frozen=True)
class _Entry:
    """One tensor to append to one file, after the tensors of earlier groups."""

    group: int
    file: int
    tensor: torch.Tensor
    dtype: torch.dtype | None  # the export dtype of the weights; None: as held


class PendingSave:
    """A checkpoint being written by its thread; `wait_written(g)` until group g is."""

    def __init__(self, *, final: Path, stack: contextlib.ExitStack, tmp: Path,
                 groups: int, files: Sequence[tuple[Path, bytes]],
                 entries: Sequence[_Entry], manifest: dict[str, Any],
                 write_bytes_per_s: float,
                 on_published: Callable[[], None]) -> None:
        self.final = final
        self._stack, self._tmp = stack, tmp
        self._files, self._entries, self._manifest = files, entries, manifest
        self._rate = write_bytes_per_s
        self._on_published = on_published
        self._written = [threading.Event() for _ in range(groups)]
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.update_waited_s = 0.0
        self.written_bytes = 0
        self.duration_s: float | None = None  # from start to publication
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
        """Block until the save has ended; raise if it failed (the previous checkpoint
        is kept)."""
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the checkpoint save to {self.final} failed, the previous "
                               f"checkpoint (if any) is kept: {type(err).__name__}: {err}"
                               ) from err

    # ---- the writer thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            with contextlib.ExitStack() as files:
                handles = [files.enter_context(open(path, "wb")) for path, _ in self._files]
                for f, (_, header) in zip(handles, self._files, strict=True):
                    f.write(header)
                self._write_groups(handles)
                for f in handles:
                    f.flush()
                    os.fsync(f.fileno())
            (self._tmp / sc.MANIFEST).write_text(json.dumps(self._manifest, indent=1))
            self._stack.close()  # fsync, rename into place: the checkpoint exists from here
        except BaseException as err:  # raised on the training thread by wait()
            self._error = err
            sc.abandon(self._stack, err)
        finally:
            for event in self._written:
                event.set()  # training goes on, whatever happened here
        if self._error is None:
            self._published()

    def _write_groups(self, handles: Sequence[BinaryIO]) -> None:
        opened = 0  # the gates of the groups before this one are open
        for entry in self._entries:
            for g in range(opened, min(entry.group, len(self._written))):
                self._written[g].set()
            opened = max(opened, entry.group)
            self._write(handles[entry.file], entry.tensor, entry.dtype)
        for event in self._written:  # every byte is in the files (the kernel's copy)
            event.set()

    def _write(self, f: BinaryIO, tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
        data = layout.tensor_bytes(tensor, dtype)
        for start in range(0, len(data), _CHUNK_BYTES):
            chunk = data[start:start + _CHUNK_BYTES]
            f.write(chunk)
            self.written_bytes += len(chunk)
            if self._rate > 0:  # a throttled writer (setting): keep to the rate
                ahead_s = (self.written_bytes / self._rate
                           - (time.perf_counter() - self._start_s))
                if ahead_s > 0:
                    time.sleep(ahead_s)

    def _published(self) -> None:
        duration_s = self.duration_s = time.perf_counter() - self._start_s
        logger.info("lazytrain: checkpoint %s written (async, %.2f s, %.3f GB at %.0f MB/s; "
                    "the update waited %.2f s for it)", self.final, duration_s,
                    self.written_bytes / 1e9, self.written_bytes / 1e6 / max(duration_s, 1e-9),
                    self.update_waited_s)
        try:
            self._on_published()
        except Exception as err:  # the checkpoint exists; rotation is best effort
            logger.warning("lazytrain: rotating old checkpoints after %s failed: %s",
                           self.final, err)


def group_order(named: Sequence[tuple[str, torch.Tensor]],
                groups: Sequence[Sequence[nn.Parameter]]
                ) -> list[tuple[int, str, torch.Tensor]]:
    """`named` sorted by the update group that writes each tensor (stable; tensors no
    update writes, such as frozen weights and buffers, after the last group)."""
    group_of = {id(p): g for g, params in enumerate(groups) for p in params}
    tagged = [(group_of.get(id(t), len(groups)), name, t) for name, t in named]
    return sorted(tagged, key=lambda item: item[0])


def start_save(accelerator: Any, final: Path, write_stock: Callable[[Path], None], *,
               on_published: Callable[[], None]) -> PendingSave:
    """Open the checkpoint's temporary directory, write the small files now and start
    the writer of the rest (module docstring). One process, after the step's update."""
    from lazytrain_accel.checkpoints.atomic import atomic_directory

    model, optimizer = accelerator._lazytrain_model, accelerator._lazytrain_optimizer
    plugin, steps = accelerator.lazytrain_plugin, accelerator.lazytrain_engine.steps
    groups = steps.update_groups
    dtype = layout.CHECKPOINT_DTYPES[plugin.checkpoint_dtype]
    stack = contextlib.ExitStack()
    tmp = stack.enter_context(atomic_directory(final))
    try:
        write_stock(tmp)  # scheduler, RNG, samplers, the plan: at this step
        files, entries = _weight_files(tmp, model, groups, plugin.checkpoint_max_shard_bytes,
                                       dtype)
        share = _share_file(tmp, optimizer, model, groups, dtype, first_file=len(files))
        files.append(share[0])
        entries = sorted([*entries, *share[1]], key=lambda e: e.group)
        manifest = sc.build_manifest(
            world_size=1, local_world_size=1, nodes=1, step=int(accelerator.step),
            layout=sc.layout_hash(model),
            optimizer=sc.optimizer_record(optimizer, sc.param_names(model)),
            shares=[share[2]])
    except BaseException as err:
        sc.abandon(stack, err)
        raise
    return PendingSave(final=final, stack=stack, tmp=tmp, groups=len(groups), files=files,
                       entries=entries, manifest=manifest,
                       write_bytes_per_s=plugin.checkpoint_write_bytes_per_s,
                       on_published=on_published)


def _weight_files(tmp: Path, model: nn.Module, groups: Sequence[Sequence[nn.Parameter]],
                  max_shard_bytes: int, dtype: torch.dtype | None
                  ) -> tuple[list[tuple[Path, bytes]], list[_Entry]]:
    """The weights' files (headers) and entries in group order; config.json and the
    index written now."""
    ordered = group_order(sc.unique_state(model), groups)
    group_of = {name: g for g, name, _ in ordered}
    shards = layout.plan_shards([(n, t) for _, n, t in ordered],
                                max_shard_bytes=max_shard_bytes, dtype=dtype)
    names = ([layout.WEIGHTS] if len(shards) == 1 else
             [layout.shard_file(i + 1, len(shards)) for i in range(len(shards))])
    files, entries = [], []
    for index, (name, shard) in enumerate(zip(names, shards, strict=True)):
        files.append((tmp / name, layout.safetensors_header(shard, dtype=dtype)))
        entries += [_Entry(group=group_of[n], file=index, tensor=t, dtype=dtype)
                    for n, t in shard]
    if len(shards) > 1:
        layout.write_index(tmp, names, shards, dtype)
    sc.write_config(tmp, model)
    return files, entries


def _share_file(tmp: Path, optimizer: torch.optim.Optimizer, model: nn.Module,
                groups: Sequence[Sequence[nn.Parameter]], dtype: torch.dtype | None, *,
                first_file: int) -> tuple[tuple[Path, bytes], list[_Entry], dict[str, Any]]:
    """The one share's file (header), entries in group order and manifest entry."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group_of = {id(p): g for g, ps in enumerate(groups) for p in ps}
    in_order = sorted(params, key=lambda p: group_of.get(id(p), len(groups)))
    tensors, metadata, written = sc.share_tensors(optimizer, in_order,
                                                  sc.param_names(model), weights_dtype=dtype)
    path = tmp / sc.share_file(0)
    header = layout.safetensors_header([(key, t) for key, t, _ in tensors], metadata=metadata)
    entries = [_Entry(group=group_of.get(id(p), len(groups)), file=first_file, tensor=t,
                      dtype=None) for _, t, p in tensors]
    record = {"rank": 0, "groups": list(range(len(groups))), "file": path.name,
              "params": written, "optimizer_steps": sc.max_step(optimizer, params)}
    return (path, header), entries, record
