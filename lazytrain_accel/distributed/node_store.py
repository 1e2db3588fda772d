"""`NodeStore`: one host copy of a model's parameters per node, in shared memory.

The local ranks map one segment and point each parameter's `.data` at its slice, so N
ranks hold one copy of the fp32 masters and frozen weights. The local leader creates it,
reserves every byte (`posix_fallocate`: a full filesystem is an error, never a SIGBUS
mid-fill), fills it and hands the descriptor to the others (`segment_handoff.py`). The
segment has no name that could outlive the job (a memfd, or a file in `node_store_dir`
unlinked at once); a file found under its name is opened only when it is a regular file
of this user that nobody else may read, else refused (`UnsafeSegmentError`). Layout: a
header (magic, version, leader pid, size, a hash of names, shapes and dtypes), one int64
generation per group, each parameter 64-byte aligned. Below fp32 compute, the layers
another node updates (the split layout) and those whose masters live on NVMe are held as
their compute copy alone (`Elsewhere`: placeholders for their masters, but the ones this
rank homes on its drive). Docs: docs/user_guide.md "7. Several GPUs".
"""

from __future__ import annotations

import contextlib
import functools
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

from lazytrain_accel import preflight
from lazytrain_accel.config import ANONYMOUS_SEGMENT
from lazytrain_accel.distributed import first_touch, segment_handoff
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.engine.memory.weights import master_dtype
from lazytrain_accel.storage.flat import flat_views

logger = logging.getLogger("lazytrain_accel")

GIB = 2**30
_MAGIC = 0x4C5A_5452_4E53_5431  # "LZTRNST1"
_VERSION = 1
_HEADER_FIELDS = 8  # int64: magic, version, pid, nbytes, layout hash, num groups, 2 spare
_ALIGN_BYTES = 64


class UnsafeSegmentError(RuntimeError):
    """A segment under the store's name exists and is not this job's private file."""


class SegmentSpaceError(RuntimeError):
    """The segment's bytes could not be reserved (a full filesystem or host memory)."""


@dataclass(frozen=True, kw_only=True)
class _Slot:
    offset_bytes: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def segment_name(*, job_id: str, node_id: str) -> str:
    """The segment's (and its handoff socket's) name: unique per (user, job, node), so two
    jobs on one host and two simulated nodes of one job never share one."""
    key = f"{os.geteuid()}|{job_id}|{node_id}".encode()
    return f"lazytrain-{hashlib.sha256(key).hexdigest()[:24]}"


def launch_identity(env: Mapping[str, str]) -> tuple[str, str]:
    """(job id, node id) from the launcher's environment (torchrun / accelerate launch):
    the run id and rendezvous endpoint name the job, the host and node rank the node."""
    job = "|".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                            "MASTER_PORT"))
    node = f"{os.uname().nodename}|{env.get('GROUP_RANK', env.get('NODE_RANK', '0'))}"
    return job, node


def unusable_because(setting: str, *, num_processes: int, env: Mapping[str, str],
                     store_dir: str = ANONYMOUS_SEGMENT) -> str | None:
    """Why the node store cannot serve this launch (then every rank keeps its own copy
    and all-reduces), or None when it can: one node of `num_processes` local ranks, or
    several nodes of LOCAL_WORLD_SIZE each (one copy per node)."""
    if setting == "off":
        return "node_store='off'"
    local = env.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1 or num_processes % int(local):
        return (f"LOCAL_WORLD_SIZE={local or 'unset'} does not divide the {num_processes} "
                "processes into nodes (launch with torchrun or accelerate launch)")
    if store_dir == ANONYMOUS_SEGMENT and not hasattr(os, "memfd_create"):
        return ("this platform has no memfd_create; set node_store_dir "
                "(LAZYTRAIN_NODE_STORE_DIR) to a shared-memory directory")
    return None


def room_for(model: nn.Module, directory: str) -> preflight.SegmentRoom:
    """`model`'s segment against the room `directory` has (`node_store_dir`: "memfd", or
    a directory). Its bytes are counted with one update generation per parameter, an
    upper bound: the plan's groups (its layers + 2) are not known before planning."""
    params = shared_params(model)
    return preflight.segment_room(directory, _layout(params, len(params) + 2)[2],
                                  available_bytes=preflight.available_host_bytes())


def shared_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the store holds: every dense one (packed quantized bases stay)."""
    from lazytrain_accel.engine.memory import quantized
    return [(n, p) for n, p in model.named_parameters() if not quantized.is_packed(p)]


class NodeStore:
    """One mapped segment; `generations.read(g)` is group g's update generation."""

    def __init__(self, *, buffer: mmap.mmap, num_groups: int) -> None:
        self._buffer = buffer  # kept alive: every parameter is a view of it
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self.header = self.bytes[:8 * _HEADER_FIELDS].view(torch.int64)
        # written only by the owners' release stores (peer_sync.py); zero when created
        self.generations = GenerationWords(buffer, offset_bytes=8 * _HEADER_FIELDS,
                                           count=num_groups)
        #: layer -> its flat compute copy, for the layers held as such (`Elsewhere`)
        self.copies: dict[int, torch.Tensor] = {}
        #: the layers of `copies` whose masters this rank keeps for its drive
        self.kept: frozenset[int] = frozenset()

    @property
    def nbytes(self) -> int:
        return self.bytes.numel()

    def view(self, slot: _Slot) -> torch.Tensor:
        flat = self.bytes[slot.offset_bytes:slot.offset_bytes + slot.nbytes]
        return flat.view(slot.dtype).view(slot.shape)


@dataclass(frozen=True, kw_only=True)
class Elsewhere:
    """The decoder layers whose masters the store does not hold (at a compute dtype below
    fp32): those another node holds (the split layout) and those homed on NVMe by the
    local rank that updates them. The store keeps each one's compute copy alone, flat in
    `dtype` in the order of its `layers[j]` (the weight pool's layout), written by the
    rank that updates it (or received from its node); their trainable parameters hold
    placeholders (`placeholder`), but those of the layers in `kept`: this rank homes
    their masters on its drive, from its own weights (`engine.attach`'s `NodeCopies`)."""

    layers: Mapping[int, Sequence[nn.Parameter]]
    dtype: torch.dtype
    kept: frozenset[int] = frozenset()

    @functools.cached_property
    def _held(self) -> frozenset[int]:
        return frozenset(id(p) for ps in self.layers.values() for p in ps)

    @functools.cached_property
    def _kept(self) -> frozenset[int]:
        return frozenset(id(p) for j in self.kept for p in self.layers[j])

    def holds_master(self, p: nn.Parameter) -> bool:
        """Whether `p`'s master is in this node's store (not elsewhere)."""
        return not (p.requires_grad and p.is_floating_point() and id(p) in self._held)

    def keeps(self, p: nn.Parameter) -> bool:
        """Whether this rank keeps `p`'s master, outside the store, for its drive."""
        return id(p) in self._kept


_NAN = {torch.float32: torch.full((), float("nan"), dtype=torch.float32)}


def placeholder(p: torch.Tensor) -> torch.Tensor:
    """A stride-0 fp32 NaN of `p`'s shape holding no bytes, in place of a master another
    node holds: a stray read poisons loudly, and it cannot be written."""
    return _NAN[master_dtype(p)].expand(p.shape)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether `t` is a `placeholder` (a master this node does not hold)."""
    nan = _NAN.get(t.dtype)
    return nan is not None and t.data_ptr() == nan.data_ptr()


def _layout(params: Sequence[tuple[str, nn.Parameter]], num_groups: int,
            elsewhere: Elsewhere | None = None
            ) -> tuple[list[_Slot | None], dict[int, _Slot], int, int]:
    """(slot per parameter, None for a master another node holds; the compute copy slot
    of each layer of `elsewhere`; total bytes; layout hash)."""
    offset = _round_up(8 * (_HEADER_FIELDS + num_groups), _ALIGN_BYTES)
    slots: list[_Slot | None] = []
    digest = hashlib.sha256()
    for name, p in params:
        if elsewhere is not None and not elsewhere.holds_master(p):
            slots.append(None)
            digest.update(f"{name}:elsewhere;".encode())
            continue
        dtype = master_dtype(p)
        slots.append(_Slot(offset_bytes=offset, shape=p.shape, dtype=dtype))
        offset = _round_up(offset + p.numel() * dtype.itemsize, _ALIGN_BYTES)
        digest.update(f"{name}:{tuple(p.shape)}:{dtype};".encode())
    copies = {}
    for layer, ps in sorted((elsewhere.layers if elsewhere is not None else {}).items()):
        numel = sum(p.numel() for p in ps)
        copies[layer] = _Slot(offset_bytes=offset, shape=torch.Size([numel]),
                              dtype=elsewhere.dtype)
        offset = _round_up(offset + numel * elsewhere.dtype.itemsize, _ALIGN_BYTES)
        digest.update(f"copy {layer}:{numel}:{elsewhere.dtype};".encode())
    return slots, copies, max(offset, 1), int.from_bytes(digest.digest()[:7], "little")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def share_model(model: nn.Module, *, name: str, leader: bool, local_ranks: int,
                num_groups: int, agree: Callable[[Exception | None], None],
                directory: Path | None = None,
                nodes: Sequence[int | None] | None = None,
                elsewhere: Elsewhere | None = None) -> NodeStore:
    """Move `model`'s parameters into the node's segment; every local rank calls it.

    The leader creates the segment (anonymous, or in `directory`: `_create`), reserves its
    bytes, fills it and listens on the handoff socket `name`; then the other
    `local_ranks - 1` ranks ask for its descriptor and map it. Afterwards each parameter's
    `.data` is a view of the segment (fp32 for trainable float parameters); the rank's own
    copy is freed as nothing else references it. `nodes` (the leader's): the NUMA node
    each of `shared_params(model)` is placed on (None: the default policy); None places
    nothing (a host of one node). `elsewhere`: the layers held as their compute copy alone
    (`NodeStore.copies`, filled by the leader from the weights as they are now).

    `agree(error)` is where the ranks meet, twice on each (after the leader's fill, after
    the followers' mapping), each with what failed on it or None; it raises on every rank
    when any rank failed, so a rank that cannot open the store stops the launch with its
    name instead of leaving the others in their next collective.
    """
    params = shared_params(model)
    slots, copy_slots, nbytes, layout_hash = _layout(params, num_groups, elsewhere)
    if not leader:
        _met(agree, None)  # the leader has filled the segment, or every rank raises
        try:
            fd = segment_handoff.receive(name)
            try:
                _check_private(fd, f"the segment handed over on @{name}")
                store = _map(fd, nbytes, num_groups)
            finally:
                os.close(fd)  # the mapping stays valid without its descriptor
            _check_header(store, nbytes=nbytes, layout_hash=layout_hash)
            _point_into(store, params, slots, copy_slots, elsewhere, copy=False)
        except Exception as err:
            _met(agree, err)
        _met(agree, None)
        return store
    with contextlib.ExitStack() as stack:
        try:
            listener = stack.enter_context(segment_handoff.listen(name, backlog=local_ranks))
            placements = () if nodes is None else first_touch.page_placements(
                [(slot.offset_bytes, slot.offset_bytes + slot.nbytes, node)
                 for slot, node in zip(slots, nodes, strict=True) if slot is not None],
                page_bytes=mmap.PAGESIZE)
            fd = _create(name, nbytes, directory, placements)
            stack.callback(os.close, fd)
            store = _map(fd, nbytes, num_groups)
            store.header.copy_(torch.tensor([_MAGIC, _VERSION, os.getpid(), nbytes,
                                             layout_hash, num_groups, 0, 0]))
            _point_into(store, params, slots, copy_slots, elsewhere, copy=True)
        except Exception as err:
            _met(agree, err)
        _met(agree, None)
        try:
            segment_handoff.serve(listener, fd, followers=local_ranks - 1)
        except Exception as err:
            _met(agree, err)
        _met(agree, None)
    return store


def _met(agree: Callable[[Exception | None], None], error: Exception | None) -> None:
    """`agree(error)`, then `error` raised here if `agree` did not raise (one rank)."""
    agree(error)
    if error is not None:
        raise error


def _point_into(store: NodeStore, params: Sequence[tuple[str, nn.Parameter]],
                slots: Sequence[_Slot | None], copy_slots: Mapping[int, _Slot],
                elsewhere: Elsewhere | None, *, copy: bool) -> None:
    """Point each parameter at its slot (`copy`: the leader's, filled from it first), a
    master held elsewhere at a placeholder (one this rank keeps stays as it is), and give
    `store` the compute copies of the layers held as such (cast from the weights before
    they are let go)."""
    if elsewhere is not None:
        store.kept = elsewhere.kept
    with torch.no_grad():
        for layer, slot in copy_slots.items():
            store.copies[layer] = store.view(slot)
            if copy:
                for p, view in zip(elsewhere.layers[layer],
                                   flat_views(store.copies[layer], elsewhere.layers[layer]),
                                   strict=True):
                    view.copy_(p.data)
        for (_, p), slot in zip(params, slots, strict=True):
            if slot is None:
                if not elsewhere.keeps(p):
                    p.data = placeholder(p)
                continue
            view = store.view(slot)
            if copy:
                view.copy_(p.data)
            p.data = view


def _create(name: str, nbytes: int, directory: Path | None,
            placements: Sequence[first_touch.Placement] = ()) -> int:
    """The leader's segment descriptor, `nbytes` reserved: anonymous (`memfd_create`), or
    in `directory` a file created exclusively, owner-only, and unlinked at once (a stale
    one of a dead leader is removed first), so no name outlives this call. `placements`
    are given their NUMA nodes before the reservation allocates the pages."""
    if directory is None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        where = "an anonymous shared segment (memfd, bounded by host memory)"
    else:
        path = directory / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            _remove_if_stale(path)
            fd = os.open(path, flags, 0o600)
        _unlink(path)  # the descriptor is the segment from here on
        os.fchmod(fd, 0o600)  # whatever the umask did
        where = str(directory)
    try:
        if placements:  # sized, not allocated: the reservation follows the policy
            os.ftruncate(fd, nbytes)
            first_touch.place(fd, nbytes, placements)
        _reserve(fd, nbytes, where)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reserve(fd: int, nbytes: int, where: str) -> None:
    """Allocate every page now: a sparse segment on a full filesystem would kill the fill
    with SIGBUS, with no message, where this raises one."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        raise SegmentSpaceError(
            f"the node store needs {nbytes} bytes ({nbytes / GIB:.2f} GiB) in {where}, and "
            f"reserving them failed ({err.strerror}). In a container, give it more shared "
            "memory (docker run --shm-size=...) or set node_store_dir "
            "(LAZYTRAIN_NODE_STORE_DIR) to a directory with room; or node_store='off' keeps "
            "a copy per rank") from None


def _remove_if_stale(path: Path) -> None:
    """Remove a private file left under our name by a killed leader: one killed before it
    unlinked the name (empty), or by an older version before it wrote its header (magic
    0). A foreign file, or a running job's, is refused and left alone."""
    fd = _open_private(path)
    try:
        with mmap.mmap(fd, 8 * _HEADER_FIELDS, prot=mmap.PROT_READ) as head:
            magic, _, pid = (int.from_bytes(head[8 * i:8 * i + 8], "little", signed=True)
                             for i in range(3))
    except ValueError:  # shorter than a header: a leader killed before it sized it
        magic, pid = 0, 0
    finally:
        os.close(fd)
    if magic not in (0, _MAGIC):
        raise UnsafeSegmentError(f"{path} exists and is not a LazyTrain segment; remove it "
                                 "or change the job's MASTER_PORT")
    if magic == _MAGIC and pid > 0 and pid_alive(pid):
        raise UnsafeSegmentError(f"{path} belongs to a running job (pid {pid}) with this "
                                 "job's id; give this job another MASTER_PORT/run id")
    logger.warning("lazytrain: removing %s, a shared segment left by a killed job (%s)",
                   path, f"pid {pid}" if magic else "its header never written")
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
    except OSError as err:  # a symlink (ELOOP), or no permission: not ours
        raise UnsafeSegmentError(f"{path} cannot be opened as this user's private segment "
                                 f"({err.strerror}); refusing to map it") from None
    try:
        _check_private(fd, str(path), mode=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_private(fd: int, what: str, *, mode: bool = False) -> None:
    """Refuse `fd` unless it is a regular file (a memfd is one) owned by this user, with
    no permission for anybody else where it has a name (`mode`); `fstat` of the open
    descriptor, so the checked file is the mapped one."""
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    elif mode and stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}, not 0600"
    if problem is not None:
        raise UnsafeSegmentError(f"{what} {problem}: another user could read or change the "
                                 "weights, so it is refused; remove it and restart the job")


def _map(fd: int, nbytes: int, num_groups: int) -> NodeStore:
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise RuntimeError(f"the node store's segment holds {size} bytes, this rank's model "
                           f"needs {nbytes}: the ranks built different models")
    return NodeStore(buffer=mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED),
                     num_groups=num_groups)


def _check_header(store: NodeStore, *, nbytes: int, layout_hash: int) -> None:
    magic, version, _, size, layout, _, _, _ = store.header.tolist()
    if magic != _MAGIC or version != _VERSION or size != nbytes:
        raise UnsafeSegmentError("the segment handed over is not the one this job's leader "
                                 "wrote (header mismatch); refusing its contents")
    if layout != layout_hash:
        raise RuntimeError("the local ranks built different models (parameter names, "
                           "shapes or dtypes differ from the local leader's); build the same "
                           "model on every rank before prepare()")


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
