"""Preflight: host memory, the NVMe directory and the node store's shared memory, checked in
`prepare` before any allocation.

The planner budgets the tiers it was told about; these checks compare a plan with what
this machine has *now*, so a run that cannot fit fails with a sentence instead of an OOM
kill an hour in, or an ENOSPC in the middle of a backward.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lazytrain_accel.config import ANONYMOUS_SEGMENT
from lazytrain_accel.planning.host import (
    MASTER_BYTES_PER_PARAM,
    activation_host_terms,
    host_base_terms,
    host_remedy,
    per_rank,
)
from lazytrain_accel.planning.node import state_shards
from lazytrain_accel.planning.plan import Home, Plan
from lazytrain_accel.planning.problem import STAGING_BOUNDARIES, layer_state_sizes
from lazytrain_accel.planning.slots import weight_slots
from lazytrain_accel.planning.state import (
    homed_parts,
    host_terms_with_state,
    nvme_state_bytes,
    weights_of,
)
from lazytrain_accel.profiling.profile import ModelProfile
from lazytrain_accel.storage.drives import drive_groups, layer_shares, split_dirs

GIB = 2**30

#: Bytes written by the NVMe writability probe (one page).
_PROBE_BYTES = 4096


class PreflightError(ValueError):
    """This machine cannot hold the run as planned (host memory or the NVMe directory)."""


@dataclass(kw_only=True, frozen=True)
class HostMemoryEstimate:
    """Host bytes a run holds at its peak, term by term (`planning/host.py`'s terms, the
    ones the planner's CPU capacity row charges)."""

    terms: tuple[tuple[str, int], ...]
    present_bytes: int  # of the total, already allocated before prepare (model weights)

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.terms)

    @property
    def new_bytes(self) -> int:
        """What the run still has to allocate."""
        return max(self.total_bytes - self.present_bytes, 0)


def estimate_host_bytes(*, model_profile: ModelProfile, plan: Plan, optimizer: str,
                        present_bytes: int) -> HostMemoryEstimate:
    """The host bytes of a run of `plan` for `model_profile` stepping `optimizer`: the
    planner's host terms (`host_base_terms`, `activation_host_terms`) at the plan's homes,
    with NVMe bounce buffers only when the plan homes anything on NVMe. A plan for a node
    of N local ranks (`Plan.gpus_per_node`, a node store) counts the node: the shared
    state once (its 1/K under the split layout over K nodes), each rank's own buffers N
    times."""
    counts = plan.count_homes()
    shards = state_shards(plan.node_layout, plan.nodes)
    base = host_base_terms(model_profile, optimizer=optimizer,
                           resident_update=plan.resident_update,
                           weight_slots=weight_slots(plan),
                           ranks=plan.gpus_per_node, shards=shards)
    if plan.state.any:  # less what the plan homes on NVMe, plus the buffers it streams by
        base = host_terms_with_state(base, weights_of(plan.state),
                                     layer_state_sizes(model_profile, optimizer,
                                                       shards=shards),
                                     staged=homed_parts(plan.state), ranks=plan.gpus_per_node,
                                     shards=shards)
    homes = activation_host_terms(boundary_bytes=plan.boundary_bytes,
                                  cpu_homes=counts[Home.CPU.value],
                                  staging_boundaries=STAGING_BOUNDARIES,
                                  nvme_staging=int(counts[Home.NVME.value] > 0),
                                  ranks=plan.gpus_per_node)
    return HostMemoryEstimate(terms=(*base, *homes), present_bytes=present_bytes)


def available_host_bytes() -> int:
    """Bytes this process may still allocate: the kernel's MemAvailable, lowered to the
    cgroup's remaining limit in a container (the OOM killer there obeys the cgroup)."""
    candidates = []
    meminfo = _read_meminfo()
    if "MemAvailable" in meminfo:
        candidates.append(meminfo["MemAvailable"])
    cgroup = _cgroup_remaining_bytes()
    if cgroup is not None:
        candidates.append(cgroup)
    if not candidates:  # not Linux: the free physical pages
        candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return max(min(candidates), 0)


def _read_meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_remaining_bytes() -> int | None:
    pairs = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
              "/sys/fs/cgroup/memory/memory.usage_in_bytes"))  # cgroup v1
    for limit_path, usage_path in pairs:
        try:
            limit = Path(limit_path).read_text().strip()
            usage = int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a huge page-aligned number (v1) mean no limit.
        if limit.isdigit() and int(limit) < 1 << 60:
            return int(limit) - usage
    return None


def check_host_memory(estimate: HostMemoryEstimate, available_bytes: int | None = None
                      ) -> None:
    """Raise `PreflightError` when the run would allocate more than is available."""
    available = available_host_bytes() if available_bytes is None else available_bytes
    if estimate.new_bytes <= available:
        return
    detail = "; ".join(f"{name} {nbytes / GIB:.2f} GiB ({host_remedy(name)})"
                       for name, nbytes in sorted(estimate.terms, key=lambda t: -t[1])
                       if nbytes)
    raise PreflightError(
        f"host memory: this run needs {estimate.new_bytes / GIB:.2f} GiB more than the "
        f"{estimate.present_bytes / GIB:.2f} GiB its weights already hold (total "
        f"{estimate.total_bytes / GIB:.2f} GiB: {detail}) but only {available / GIB:.2f} GiB "
        "is available. Set cpu_memory_limit_gb (--cpu-memory-gb) below what is free so "
        "the plan keeps fewer activations in DRAM, lower the batch, or free host memory.")


def nvme_need_bytes(plan: Plan, model_profile: ModelProfile | None = None,
                    optimizer: str = "hybrid8bit") -> int:
    """Bytes of boundary files one micro-batch of `plan` keeps on NVMe at its peak, and
    (given the model) of the host state it homes there."""
    state = 0 if model_profile is None or not plan.state.any else nvme_state_bytes(
        weights_of(plan.state), layer_state_sizes(model_profile, optimizer))
    return plan.count_homes()[Home.NVME.value] * plan.boundary_bytes + state


def check_nvme_dir(nvme_dir: str, need_bytes: int, *, num_layers: int = 1) -> None:
    """Raise `PreflightError` unless the directories `nvme_dir` names (one per drive,
    `storage/drives.py`) can take `need_bytes` of boundary and state files, spread over
    them as the engine does (layer j's files in directory j % D, of `num_layers` layers;
    directories on one file system share its free space).

    A missing directory is created when its parent exists (the default `<tmp>/lazytrain_nvme`
    case); a missing parent is an error, as it usually means a mistyped or unmounted drive.
    Nothing is checked when the plan homes nothing on NVMe.
    """
    if need_bytes <= 0:
        return
    how = "point nvme_dir (LAZYTRAIN_NVME_DIR) at a directory on a local NVMe drive"
    dirs = split_dirs(nvme_dir)
    for path in dirs:
        _check_usable(path, how)
    share = dict(zip(dirs, layer_shares(num_layers, len(dirs)), strict=True))
    for group in drive_groups(dirs):
        need = math.ceil(need_bytes * min(1.0, sum(share[path] for path in group)))
        free = shutil.disk_usage(group[0]).free
        if free < need:
            where = " and ".join(repr(str(p)) for p in group)
            raise PreflightError(
                f"nvme_dir {where} has {free / GIB:.2f} GiB free but the plan keeps "
                f"{need / GIB:.2f} GiB of activations and host state there; free space, "
                f"{how} with more room (or add a drive: one directory per drive, joined by "
                "','), or plan with nvme_limit_gb below the free space")


def _check_usable(path: Path, how: str) -> None:
    """`path` is a writable directory (created when only it is missing)."""
    try:
        exists = path.exists()
    except OSError as err:  # a parent this user may not search
        raise PreflightError(f"nvme_dir {str(path)!r} cannot be accessed ({err.strerror}); "
                             f"fix the permissions of its parents or {how}") from None
    if exists and not path.is_dir():
        raise PreflightError(f"nvme_dir {str(path)!r} is a file, not a directory; {how}")
    if not exists:
        if not path.parent.is_dir():
            raise PreflightError(f"nvme_dir {str(path)!r} does not exist, nor does its parent "
                                 f"{str(path.parent)!r} (an unmounted or mistyped drive?); "
                                 f"create it or {how}")
        try:
            path.mkdir(exist_ok=True)
        except OSError as err:
            raise PreflightError(f"nvme_dir {str(path)!r} does not exist and cannot be "
                                 f"created ({err.strerror}); {how}") from None
    _probe_writable(path, how)


def _probe_writable(path: Path, how: str) -> None:
    """Write and delete one page: permission bits alone miss read-only mounts and ACLs."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".lazytrain-probe-", dir=path)
    except OSError as err:
        raise PreflightError(f"nvme_dir {str(path)!r} is not writable ({err.strerror}); "
                             f"fix its permissions or {how}") from None
    try:
        os.write(fd, b"\0" * _PROBE_BYTES)
        os.fsync(fd)
    except OSError as err:
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        raise PreflightError(f"nvme_dir {str(path)!r}: a {_PROBE_BYTES}-byte test write "
                             f"failed ({err.strerror}); "
                             + ("free space or " if full else "") + how) from None
    finally:
        os.close(fd)
        os.unlink(probe)


#: The host term of a checkpoint's serialization buffer (`save_buffer_bytes`).
SAVE_BUFFER_TERM = "checkpoint save buffer (one tensor)"

#: Bytes per element of each named `checkpoint_dtype` (config.CHECKPOINT_DTYPE_CHOICES;
#: "auto" writes every tensor as held: nothing is cast).
_CHECKPOINT_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def save_buffer_bytes(model: object, *, checkpoint_dtype: str, resident_update: str) -> int:
    """The host bytes a save holds beyond the run's state: the writer
    (checkpoints/layout.py `tensor_bytes`) writes a tensor from where it lives and copies
    one, alone, only to cast it to `checkpoint_dtype` or to read it off the device (the
    residents' masters and states under `resident_update="device"`). The bound is the
    largest such copy, with every tensor counted as possibly on the device there, in fp32
    where it is floating (the engine's masters); 0 when nothing is copied."""
    itemsize = _CHECKPOINT_ITEMSIZE.get(checkpoint_dtype)
    largest_bytes = 0
    tensors = itertools.chain(model.parameters(), model.buffers())  # type: ignore[attr-defined]
    for tensor in tensors:
        floating = tensor.is_floating_point()
        cast = (itemsize is not None and floating
                and str(tensor.dtype).removeprefix("torch.") != checkpoint_dtype)
        if cast or resident_update == "device":
            held = max(tensor.element_size(), MASTER_BYTES_PER_PARAM if floating else 0)
            largest_bytes = max(largest_bytes, tensor.numel() * (itemsize if cast else held))
    return largest_bytes


def check_run(*, model: object, plan: Plan, model_profile: ModelProfile, optimizer: str,
              nvme_dir: str, checkpoint_dtype: str, available_bytes: int | None = None
              ) -> HostMemoryEstimate:
    """Both checks for `model` (a torch module, profiled as `model_profile`) about to run
    `plan` with `optimizer`, saving its checkpoints in `checkpoint_dtype`; returns the host
    estimate, a save's buffer included (each of a node's ranks writes its own share).
    Called by `prepare` after planning and before the engine allocates. With a plan for
    N local ranks the node is checked: every rank built its model (N copies present, which
    the node store replaces by one),
    and `available_bytes` should be the same figure on every rank (the ranks' least), so
    they pass or refuse together."""
    params = model.parameters()  # type: ignore[attr-defined]
    estimate = estimate_host_bytes(
        model_profile=model_profile, plan=plan, optimizer=optimizer,
        present_bytes=plan.gpus_per_node * sum(p.numel() * p.element_size() for p in params
                                               if p.device.type == "cpu"))
    buffer_bytes = save_buffer_bytes(model, checkpoint_dtype=checkpoint_dtype,
                                     resident_update=plan.resident_update)
    ranks = plan.gpus_per_node
    estimate = dataclasses.replace(estimate, terms=(
        *estimate.terms, (per_rank(SAVE_BUFFER_TERM, ranks), ranks * buffer_bytes)))
    check_host_memory(estimate, available_bytes)
    check_nvme_dir(nvme_dir, nvme_need_bytes(plan, model_profile, optimizer),
                   num_layers=plan.num_layers)
    return estimate


SHM_DIR = "/dev/shm"


@dataclass(kw_only=True, frozen=True)
class SegmentRoom:
    """The node store's bytes against what can hold them: an anonymous segment's pages
    come from host memory (`node_store_dir="memfd"`), a file's from its filesystem."""

    directory: str  # ANONYMOUS_SEGMENT, or the directory of a file-backed segment
    need_bytes: int
    free_bytes: int  # the directory's free bytes; for an anonymous segment, host memory's

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes

    def describe(self) -> str:
        """One line for the logs and `lazytrain plan`: the store beside the room it has."""
        store = f"node store {self.need_bytes / GIB:.2f} GiB"
        if self.directory == ANONYMOUS_SEGMENT:
            return (f"{store} in an anonymous segment (memfd: host memory bounds it, "
                    f"{self.free_bytes / GIB:.2f} GiB available; {SHM_DIR} "
                    f"{shm_free_bytes(SHM_DIR) / GIB:.2f} GiB free does not)")
        return f"{store} in {self.directory} ({self.free_bytes / GIB:.2f} GiB free)"


def shm_free_bytes(directory: str) -> int:
    """Free bytes of the filesystem holding `directory` (0 where it does not exist)."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def segment_room(directory: str, need_bytes: int, *, available_bytes: int) -> SegmentRoom:
    """`need_bytes` of node store in `directory` (or anonymous: `available_bytes` of host
    memory hold it, the host check counting it once per node)."""
    free = (available_bytes if directory == ANONYMOUS_SEGMENT
            else shm_free_bytes(directory))
    return SegmentRoom(directory=directory, need_bytes=need_bytes, free_bytes=free)


def node_store_bytes(model_profile: ModelProfile) -> int:
    """The node store's bytes for a profiled model: fp32 masters of the trainable
    parameters and frozen weights as stored, bitsandbytes-packed ones left out (they stay
    in each rank's model)."""
    w = model_profile.weights
    packed = 0 if w is None else model_profile.num_layers * w.layer_packed_bytes
    return (MASTER_BYTES_PER_PARAM * model_profile.trainable_param_count
            + model_profile.frozen_host_bytes - packed)


def check_per_rank_copies(room: SegmentRoom, estimate: HostMemoryEstimate, *, copies: int,
                          available_bytes: int) -> str:
    """`room` cannot hold the node store: each of the node's `copies` ranks would keep its
    own copy (`estimate`, one rank's). Return the warning that says so, or raise
    `PreflightError` with the same numbers when host memory cannot take the copies."""
    fix = (f"give the container more shared memory (docker run --shm-size="
           f"{math.ceil(room.need_bytes * 1.1 / GIB)}g), set node_store_dir "
           f"(LAZYTRAIN_NODE_STORE_DIR) to a directory with room, or leave it at "
           f"'{ANONYMOUS_SEGMENT}' (the default: host memory bounds the store)")
    shortfall = (f"the node store needs {room.need_bytes / GIB:.2f} GiB in {room.directory}, "
                 f"which has {room.free_bytes / GIB:.2f} GiB free")
    copies_bytes = copies * estimate.new_bytes
    if copies_bytes > available_bytes:
        raise PreflightError(
            f"{shortfall}, and a copy per rank instead needs {copies} x "
            f"{estimate.new_bytes / GIB:.2f} GiB of host memory with only "
            f"{available_bytes / GIB:.2f} GiB available. To run: {fix}.")
    return (f"{shortfall}: each of the node's {copies} ranks keeps its own copy instead "
            f"({copies} x {estimate.new_bytes / GIB:.2f} GiB of host memory, "
            f"{available_bytes / GIB:.2f} GiB available; gradients all-reduced). To share "
            f"one copy: {fix}.")
