"""How many threads torch's intra-op pool gets, so a LazyTrain step does not oversubscribe
the cores (docs/user_guide.md "2. Configuration", `threads`).

A step keeps the training thread, the update thread (whose kernel sizes itself from the
same pool setting) and the NVMe copy worker busy at once, and OpenMP workers spin while
they wait, so a pool larger than the free cores is much worse than a smaller one. The
rule: the usable cores (`sched_getaffinity`), divided among this machine's training
processes (`LOCAL_WORLD_SIZE`) unless the launcher pinned each, less the cores other
processes keep busy (watched for a quarter second), less 1 on a GPU run; at least 1.
`LazyTrainConfig.threads` = N > 0 sets N; with 0, an `OMP_NUM_THREADS` is kept.
"""

from __future__ import annotations

import logging
import os
import time

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


#: How long `busy_cores_elsewhere` watches the machine.
SAMPLE_S = 0.25


def busy_cores_elsewhere(cores: int) -> int:
    """Cores other processes keep busy, at most `cores - 1` (this process needs one).

    Measured over `SAMPLE_S`: the machine's busy CPU seconds (/proc/stat) minus this
    process's own (`os.times`), per second of wall time, rounded. The load average would
    count this process's own start-up work (tokenizing, measuring the hardware) as load;
    it is the fallback where /proc/stat is missing."""
    busy_s = _other_processes_cpu_s(SAMPLE_S)
    if busy_s is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:
            return 0
    else:
        busy = busy_s / SAMPLE_S
    return max(0, min(cores - 1, round(busy)))


def _other_processes_cpu_s(window_s: float) -> float | None:
    """CPU seconds all other processes used during `window_s` (None without /proc)."""
    before, own_before, start = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    if before is None:
        return None
    time.sleep(window_s)
    after, own_after = _machine_busy_s(), _own_cpu_s()
    if after is None:
        return None
    scale = window_s / max(time.perf_counter() - start, 1e-9)  # the sleep may run long
    return max(0.0, (after - before) - (own_after - own_before)) * scale


def _machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot, summed over its cores."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


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
