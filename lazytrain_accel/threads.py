"""How many threads torch's intra-op pool gets, so a LazyTrain step does not
oversubscribe the cores (docs/user_guide.md "Threads").

A step keeps three kinds of threads busy: the training thread (forward and backward,
through torch's intra-op pool), the update thread (the hybrid 8-bit AdamW kernel, whose
`at::parallel_for` sizes itself from the same pool setting, from its own thread) and the
copy workers (the NVMe writer; it waits on the disk, not on a core). OpenMP workers spin
while they wait, so a pool larger than the free cores does not just share them: under one
competing busy process on 2 cores the demo ran at half the speed of one thread. The rule:

    threads = usable cores (sched_getaffinity: taskset, cgroup cpusets), divided among
              this machine's training processes (LOCAL_WORLD_SIZE, set by torchrun and
              accelerate launch) unless the launcher already pinned each to its own cores
              - cores other processes keep busy (the 1-minute load average, rounded, also
              divided among them)
              - 1 on a GPU run (the training thread launches kernels and drives copies
                while the update kernel runs; on a CPU run it *is* the pool's first thread)

at least 1. `LazyTrainConfig.threads` (`LAZYTRAIN_THREADS`) = N > 0 sets N instead; with
the default 0, an `OMP_NUM_THREADS` in the environment is the user's choice and is kept.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("lazytrain_accel")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cores_for_this_process() -> int:
    """This process's share of the usable cores: all of them when alone on the machine or
    pinned to its own cores (an affinity mask narrower than the machine), else an equal
    share among the LOCAL_WORLD_SIZE ranks of a multi-process launch."""
    cores = usable_cores()
    ranks = _local_world_size()
    if ranks <= 1 or cores < (os.cpu_count() or cores):
        return cores
    return max(1, cores // ranks)


def _local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def busy_cores_elsewhere(cores: int) -> int:
    """Cores other processes keep busy: the 1-minute load average, rounded, at most
    `cores - 1` (this process needs one). Read before training starts, so it is mostly
    other processes' load."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 0
    return max(0, min(cores - 1, round(load)))


def thread_count(*, cores: int, busy_elsewhere: int, gpu: bool) -> int:
    """The rule of the module docstring, as a pure function."""
    return max(1, cores - busy_elsewhere - int(gpu))


def apply_threads(requested: int, *, device: torch.device) -> int:
    """Size torch's intra-op pool (and so the update kernel's) for this run; returns the
    count in effect. `requested` > 0 is used as is; 0 applies the rule, unless
    `OMP_NUM_THREADS` is set (then torch's own setting is kept)."""
    if requested < 0:
        raise ValueError(f"threads={requested} must be >= 0 (0 = the rule of "
                         "lazytrain_accel/threads.py)")
    if requested == 0 and os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    if requested > 0:
        count = requested
    else:
        cores = cores_for_this_process()
        busy = busy_cores_elsewhere(usable_cores()) // _local_world_size()
        count = thread_count(cores=cores, busy_elsewhere=min(busy, cores - 1),
                             gpu=device.type == "cuda")
    if count != torch.get_num_threads():
        logger.info("lazytrain: torch intra-op threads %d -> %d", torch.get_num_threads(),
                    count)
        torch.set_num_threads(count)
    return count
