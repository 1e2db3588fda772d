"""`NodeStore`: one host copy of a model's parameters per node, in shared memory.

The local ranks of a node map one segment (a file under /dev/shm) and point each
parameter's `.data` at its slice of it, so N ranks hold one copy of the fp32 masters (and
of frozen weights) instead of N. The local leader (local rank 0) creates the segment
exclusively (`O_CREAT | O_EXCL`, mode 0600), fills it from its model, and the others map
it once it is full; when every rank has mapped it the leader unlinks its name, so the
mapping lives on with no name left to leak, crash or not. Until then an `atexit` hook
removes it; a segment left by a killed job (the pid in its header is not alive) is
removed with a warning at the next start under the same name.

Safety: a segment is mapped only when it is a regular file owned by this user with no
permission for anybody else (`fstat` of the descriptor opened, so the checked file is the
mapped one); anything else is refused with `UnsafeSegmentError`, never read or removed.

Layout: a header (magic, version, the leader's pid, the byte size, a hash of the
parameters' names, shapes and dtypes, so ranks that built different models fail at
`prepare`), one int64 update generation per parameter group (`generations`, see
`integrations/split_update.py`), then each parameter, 64-byte aligned.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import mmap
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lazytrain_accel.integrations.generation_words import GenerationWords

logger = logging.getLogger("lazytrain_accel")

SHM_DIR = Path("/dev/shm")
_MAGIC = 0x4C5A_5452_4E53_5431  # "LZTRNST1"
_VERSION = 1
_HEADER_FIELDS = 8  # int64: magic, version, pid, nbytes, layout hash, num groups, 2 spare
_ALIGN_BYTES = 64


class UnsafeSegmentError(RuntimeError):
    """A segment under the store's name exists and is not this job's private file."""


@dataclass(frozen=True, kw_only=True)
class _Slot:
    offset_bytes: int
    shape: torch.Size
    dtype: torch.dtype


def segment_path(*, job_id: str, node_id: str, directory: Path = SHM_DIR) -> Path:
    """The segment's path: unique per (user, job, node), so two jobs on one host and two
    simulated nodes of one job never share a name."""
    key = f"{os.geteuid()}|{job_id}|{node_id}".encode()
    return directory / f"lazytrain-{hashlib.sha256(key).hexdigest()[:24]}"


def launch_identity(env: Mapping[str, str]) -> tuple[str, str]:
    """(job id, node id) from the launcher's environment (torchrun / accelerate launch):
    the run id and rendezvous endpoint name the job, the host and node rank the node."""
    job = "|".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                            "MASTER_PORT"))
    node = f"{os.uname().nodename}|{env.get('GROUP_RANK', env.get('NODE_RANK', '0'))}"
    return job, node


def unusable_because(setting: str, *, num_processes: int, env: Mapping[str, str]
                     ) -> str | None:
    """Why the node store cannot serve this launch (then every rank keeps its own copy
    and all-reduces), or None when it can: one node of `num_processes` local ranks, or
    several nodes of LOCAL_WORLD_SIZE each (one copy per node)."""
    if setting == "off":
        return "node_store='off'"
    local = env.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1 or num_processes % int(local):
        return (f"LOCAL_WORLD_SIZE={local or 'unset'} does not divide the {num_processes} "
                "processes into nodes (launch with torchrun or accelerate launch)")
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR} does not exist on this host"
    return None


def shared_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the store holds: every dense one (packed quantized bases stay)."""
    from lazytrain_accel.engine import quantized

    return [(n, p) for n, p in model.named_parameters() if not quantized.is_packed(p)]


def _master_dtype(p: nn.Parameter) -> torch.dtype:
    return torch.float32 if p.requires_grad and p.is_floating_point() else p.dtype


class NodeStore:
    """One mapped segment; `generations.read(g)` is group g's update generation."""

    def __init__(self, *, path: Path, buffer: mmap.mmap, num_groups: int) -> None:
        self.path = path
        self._buffer = buffer  # kept alive: every parameter is a view of it
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self.header = self.bytes[:8 * _HEADER_FIELDS].view(torch.int64)
        # written only by the owners' release stores (split_update.py); zero when created
        self.generations = GenerationWords(buffer, offset_bytes=8 * _HEADER_FIELDS,
                                           count=num_groups)

    @property
    def nbytes(self) -> int:
        return self.bytes.numel()

    def view(self, slot: _Slot) -> torch.Tensor:
        size = slot.shape.numel() * slot.dtype.itemsize
        flat = self.bytes[slot.offset_bytes:slot.offset_bytes + size]
        return flat.view(slot.dtype).view(slot.shape)


def _layout(params: Sequence[tuple[str, nn.Parameter]], num_groups: int
            ) -> tuple[list[_Slot], int, int]:
    """(slot per parameter, total bytes, layout hash)."""
    offset = _round_up(8 * (_HEADER_FIELDS + num_groups), _ALIGN_BYTES)
    slots, digest = [], hashlib.sha256()
    for name, p in params:
        dtype = _master_dtype(p)
        slots.append(_Slot(offset_bytes=offset, shape=p.shape, dtype=dtype))
        offset = _round_up(offset + p.numel() * dtype.itemsize, _ALIGN_BYTES)
        digest.update(f"{name}:{tuple(p.shape)}:{dtype};".encode())
    return slots, max(offset, 1), int.from_bytes(digest.digest()[:7], "little")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def share_model(model: nn.Module, *, path: Path, leader: bool, num_groups: int,
                barrier: Callable[[], None]) -> NodeStore:
    """Move `model`'s parameters into the segment at `path`; every local rank calls it.

    The leader creates and fills the segment, `barrier()` (all local ranks) lets the
    others map it, a second `barrier()` lets the leader unlink the name. Afterwards each
    parameter's `.data` is a view of the segment (fp32 for trainable float parameters);
    the rank's own copy is freed as nothing else references it.
    """
    params = shared_params(model)
    slots, nbytes, layout_hash = _layout(params, num_groups)
    fd = _create(path, nbytes) if leader else -1
    try:
        if leader:
            store = _map(fd, path, nbytes, num_groups)
            store.header.copy_(torch.tensor([_MAGIC, _VERSION, os.getpid(), nbytes,
                                             layout_hash, num_groups, 0, 0]))
            _point_into(store, params, slots, copy=True)
        barrier()
        if not leader:
            fd = _open_private(path)
            store = _map(fd, path, nbytes, num_groups)
            _check_header(store, path, nbytes=nbytes, layout_hash=layout_hash)
            _point_into(store, params, slots, copy=False)
        barrier()
    finally:
        if fd >= 0:
            os.close(fd)  # the mapping stays valid without its descriptor
        if leader:
            _unlink(path)
    return store


def _point_into(store: NodeStore, params: Sequence[tuple[str, nn.Parameter]],
                slots: Sequence[_Slot], *, copy: bool) -> None:
    with torch.no_grad():
        for (_, p), slot in zip(params, slots, strict=True):
            view = store.view(slot)
            if copy:
                view.copy_(p.data)
            p.data = view


def _create(path: Path, nbytes: int) -> int:
    """Create the segment exclusively, owner-only; remove a stale one of a dead leader."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        _remove_if_stale(path)
        fd = os.open(path, flags, 0o600)
    atexit.register(_unlink, path)  # until every rank mapped it (then it is gone)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask did
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd


def _remove_if_stale(path: Path) -> None:
    fd = _open_private(path)
    try:
        with mmap.mmap(fd, 8 * _HEADER_FIELDS, prot=mmap.PROT_READ) as head:
            magic, _, pid = (int.from_bytes(head[8 * i:8 * i + 8], "little", signed=True)
                             for i in range(3))
    except ValueError:  # shorter than a header: a leader killed before it sized it
        magic, pid = _MAGIC, 0
    finally:
        os.close(fd)
    if magic != _MAGIC:
        raise UnsafeSegmentError(f"{path} exists and is not a LazyTrain segment; remove it "
                                 "or change the job's MASTER_PORT")
    if pid > 0 and pid_alive(pid):
        raise UnsafeSegmentError(f"{path} belongs to a running job (pid {pid}) with this "
                                 "job's id; give this job another MASTER_PORT/run id")
    logger.warning("lazytrain: removing %s, a shared segment left by a killed job (pid %d)",
                   path, pid)
    _unlink(path)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is not a zombie (a killed rank stays one
    until its launcher reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc/self").is_dir():  # no procfs: kill(0) is all there is
        return True
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # reaped meanwhile
        return False
    return stat_line.rpartition(")")[2].split()[0] not in ("Z", "X")


def _open_private(path: Path) -> int:
    """Open `path` read-write only if it is a regular file of ours, mode 0600."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise RuntimeError(f"{path}: the local leader's shared segment is missing; the "
                           "leader failed before filling it (see rank 0's error)") from None
    except OSError as err:  # a symlink (ELOOP), or no permission: not ours
        raise UnsafeSegmentError(f"{path} cannot be opened as this user's private segment "
                                 f"({err.strerror}); refusing to map it") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    elif stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}, not 0600"
    if problem is not None:
        os.close(fd)
        raise UnsafeSegmentError(f"{path} {problem}: another user could read or change the "
                                 "weights, so it is refused; remove it and restart the job")
    return fd


def _map(fd: int, path: Path, nbytes: int, num_groups: int) -> NodeStore:
    if os.fstat(fd).st_size != nbytes:
        raise RuntimeError(f"{path} holds {os.fstat(fd).st_size} bytes, this rank's model "
                           f"needs {nbytes}: the ranks built different models")
    return NodeStore(path=path, buffer=mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED),
                     num_groups=num_groups)


def _check_header(store: NodeStore, path: Path, *, nbytes: int, layout_hash: int) -> None:
    magic, version, _, size, layout, _, _, _ = store.header.tolist()
    if magic != _MAGIC or version != _VERSION or size != nbytes:
        raise UnsafeSegmentError(f"{path} is not the segment this job's leader wrote "
                                 "(header mismatch); refusing its contents")
    if layout != layout_hash:
        raise RuntimeError("the local ranks built different models (parameter names, "
                           "shapes or dtypes differ from the local leader's); build the same "
                           "model on every rank before prepare()")


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
