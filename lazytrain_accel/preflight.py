"""Preflight: host memory and the NVMe directory, checked in `prepare` before any allocation.

The planner budgets the tiers it was told about; these checks compare a plan with what
this machine has *now*, so a run that cannot fit fails with a sentence instead of an OOM
kill an hour in, or an ENOSPC in the middle of a backward.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lazytrain_accel.planning.plan import Home, Plan

GIB = 2**30

#: Host bytes of optimizer state per trainable parameter. Hybrid 8-bit: two 1-byte moments
#: plus one fp32 absmax per 256-value block of each. A kept optimizer is priced as AdamW
#: (two fp32 moments), the most common choice and an upper bound for SGD-like ones.
OPTIMIZER_STATE_BYTES_PER_PARAM = {"hybrid8bit": 2 + 2 * 4 / 256, "keep": 8.0}

#: Bytes written by the NVMe writability probe (one page).
_PROBE_BYTES = 4096


class PreflightError(ValueError):
    """This machine cannot hold the run as planned (host memory or the NVMe directory)."""


@dataclass(kw_only=True, frozen=True)
class HostMemoryEstimate:
    """Host bytes a run holds at its peak, by what holds them."""

    master_bytes: int  # fp32 master weights (+ frozen weights as stored)
    grad_bytes: int  # fp32 gradient accumulators of trainable parameters
    optimizer_state_bytes: int
    pinned_staging_bytes: int  # weight and gradient staging, NVMe bounce buffers
    cpu_activation_bytes: int  # boundaries the plan homes in host DRAM
    present_bytes: int  # of the above, already allocated before prepare (model weights)
    # compute-dtype copies of the streamed layers, written by the overlapped update
    compute_copy_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.master_bytes + self.grad_bytes + self.optimizer_state_bytes
                + self.pinned_staging_bytes + self.cpu_activation_bytes
                + self.compute_copy_bytes)

    @property
    def new_bytes(self) -> int:
        """What the run still has to allocate."""
        return max(self.total_bytes - self.present_bytes, 0)


def estimate_host_bytes(*, param_count: int, trainable_param_count: int, present_bytes: int,
                        optimizer: str, plan: Plan, layer_param_bytes: int,
                        layer_grad_bytes: int, compute_copy_bytes: int = 0,
                        frozen_bytes: int = 0) -> HostMemoryEstimate:
    """The host bytes of a run of `plan` (see `HostMemoryEstimate`'s fields): fp32 masters
    of `param_count` parameters, and `frozen_bytes` of frozen weights kept as stored."""
    if optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAM:
        raise ValueError(f"optimizer={optimizer!r}: expected one of "
                         f"{sorted(OPTIMIZER_STATE_BYTES_PER_PARAM)}")
    counts = plan.count_homes()
    bounce = 2 * plan.boundary_bytes if counts[Home.NVME.value] else 0
    return HostMemoryEstimate(
        master_bytes=4 * param_count + frozen_bytes,
        grad_bytes=4 * trainable_param_count,
        optimizer_state_bytes=int(OPTIMIZER_STATE_BYTES_PER_PARAM[optimizer]
                                  * trainable_param_count),
        # Two layers of weights in flight H2D, two of gradients D2H (engine/weights, grads).
        pinned_staging_bytes=2 * layer_param_bytes + 2 * layer_grad_bytes + bounce,
        cpu_activation_bytes=counts[Home.CPU.value] * plan.boundary_bytes,
        present_bytes=present_bytes,
        compute_copy_bytes=compute_copy_bytes,
    )


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
    parts = (("fp32 masters", estimate.master_bytes), ("gradients", estimate.grad_bytes),
             ("optimizer state", estimate.optimizer_state_bytes),
             ("pinned staging", estimate.pinned_staging_bytes),
             ("CPU-home activations", estimate.cpu_activation_bytes))
    detail = ", ".join(f"{name} {nbytes / GIB:.2f}" for name, nbytes in parts)
    raise PreflightError(
        f"host memory: this run needs {estimate.new_bytes / GIB:.2f} GiB more than the "
        f"{estimate.present_bytes / GIB:.2f} GiB its weights already hold (total "
        f"{estimate.total_bytes / GIB:.2f} GiB: {detail}) but only {available / GIB:.2f} GiB "
        "is available. Set cpu_memory_limit_gb below what is free so the plan keeps fewer "
        "activations in DRAM (NVMe or recompute instead), lower the batch, use "
        "optimizer='hybrid8bit', or free host memory.")


def nvme_need_bytes(plan: Plan) -> int:
    """Bytes of boundary files one micro-batch of `plan` keeps on NVMe at its peak."""
    return plan.count_homes()[Home.NVME.value] * plan.boundary_bytes


def check_nvme_dir(nvme_dir: str, need_bytes: int) -> None:
    """Raise `PreflightError` unless `nvme_dir` can take `need_bytes` of boundary files.

    A missing directory is created when its parent exists (the default `<tmp>/lazytrain_nvme`
    case); a missing parent is an error, as it usually means a mistyped or unmounted drive.
    Nothing is checked when the plan homes nothing on NVMe.
    """
    if need_bytes <= 0:
        return
    path = Path(nvme_dir)
    how = "point nvme_dir (LAZYTRAIN_NVME_DIR) at a directory on a local NVMe drive"
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
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise PreflightError(
            f"nvme_dir {str(path)!r} has {free / GIB:.2f} GiB free but the plan keeps "
            f"{need_bytes / GIB:.2f} GiB of activations there; free space, {how} with more "
            "room, or plan with nvme_limit_gb below the free space")


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


def check_run(*, model: object, plan: Plan, layer_param_bytes: int, layer_grad_bytes: int,
              optimizer: str, nvme_dir: str, available_bytes: int | None = None,
              compute_copy_bytes: int = 0) -> HostMemoryEstimate:
    """Both checks for `model` (a torch module) about to run `plan`; returns the host
    estimate. Called by `prepare` after planning and before the engine allocates."""
    params = list(model.parameters())  # type: ignore[attr-defined]
    # Trainable parameters get fp32 masters; frozen ones stay as stored (packed or a dtype).
    frozen_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    estimate = estimate_host_bytes(
        param_count=sum(p.numel() for p in params if p.requires_grad),
        frozen_bytes=frozen_bytes,
        trainable_param_count=sum(p.numel() for p in params if p.requires_grad),
        present_bytes=sum(p.numel() * p.element_size() for p in params
                          if p.device.type == "cpu"),
        optimizer=optimizer, plan=plan, layer_param_bytes=layer_param_bytes,
        layer_grad_bytes=layer_grad_bytes, compute_copy_bytes=compute_copy_bytes)
    check_host_memory(estimate, available_bytes)
    check_nvme_dir(nvme_dir, nvme_need_bytes(plan))
    return estimate
