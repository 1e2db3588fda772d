"""Cores per rank: each local rank of a launch bound to a set of cores of its own.

At `prepare` each local rank binds every thread it has (and so the ones it starts later)
to its part of the cores the launcher left usable (`sched_getaffinity`: taskset, cgroup
cpusets), so the memory it first touches lands on its socket. The sets are disjoint and
cover the usable cores; on a multi-socket host each socket gets at least one rank, and a
rank stays inside one socket whenever there are at least as many ranks as sockets; with
more ranks than cores, rank r takes core r mod cores. Not bound: a launcher that pinned
the ranks itself (their masks differ), an explicit `threads`, `bind_cores="off"`.
Docs: docs/user_guide.md "7. Several GPUs" ("Cores per rank").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("lazytrain_accel")

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> set[int]:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def numa_nodes(root: Path = NODE_ROOT) -> dict[int, set[int]]:
    """The CPUs of each NUMA node with CPUs, by node number (what `mbind` names); empty
    where the host does not say (no sysfs). A node of memory only (CXL) is left out."""
    found = {int(n.name[4:]): parse_cpulist((n / "cpulist").read_text())
             for n in root.glob("node[0-9]*") if (n / "cpulist").is_file()}
    return {node: cpus for node, cpus in sorted(found.items()) if cpus}


def sockets(root: Path = NODE_ROOT) -> list[set[int]]:
    """The CPUs of each NUMA node (socket), in node order; one set of every CPU where
    the host does not say (no sysfs)."""
    return list(numa_nodes(root).values()) or [set(range(os.cpu_count() or 1))]


def node_of_cores(cpus: set[int], nodes: dict[int, set[int]]) -> int | None:
    """The NUMA node holding most of `cpus` (a rank's bound cores; the lowest node on a
    tie), or None when no node holds any of them."""
    counts = {node: len(cpus & node_cpus) for node, node_cpus in nodes.items()}
    best = max(counts, key=lambda node: (counts[node], -node), default=None)
    return best if best is not None and counts[best] else None


def _deal(counts: Sequence[int], total: int) -> list[int]:
    """`total` (<= sum(counts)) items dealt in proportion to `counts` (largest
    remainder), none above its count."""
    whole = sum(counts)
    if total == 0:
        return [0] * len(counts)
    shares = [total * c // whole for c in counts]
    order = sorted(range(len(counts)), key=lambda i: -(total * counts[i] % whole))
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    return shares


def _cut(cores: list[int], parts: int) -> list[list[int]]:
    """`cores` in `parts` contiguous runs whose sizes differ by at most one."""
    size, extra = divmod(len(cores), parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        runs.append(cores[start:end])
        start = end
    return runs


def split_cores(usable: set[int], socket_cpus: Sequence[set[int]], ranks: int
                ) -> list[list[int]]:
    """Each local rank's cores (module docstring): disjoint, covering `usable`, a rank
    inside one socket where there are at least as many ranks as sockets with cores."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    if not usable:
        raise ValueError("no usable cores to split among the ranks")
    ordered = sorted(usable)
    if ranks > len(ordered):  # the sharing rule: one core each, round-robin
        return [[ordered[r % len(ordered)]] for r in range(ranks)]
    per_socket = [sorted(s & usable) for s in socket_cpus]
    per_socket = [s for s in per_socket if s]
    rest = sorted(usable - set().union(*map(set, per_socket)))
    if rest:  # CPUs no node lists: a socket of their own
        per_socket.append(rest)
    if ranks < len(per_socket):
        return _cut([c for s in per_socket for c in s], ranks)
    # one rank per socket, so every core is someone's; the others in proportion
    dealt = _deal([len(s) - 1 for s in per_socket], ranks - len(per_socket))
    return [run for cores, n in zip(per_socket, dealt, strict=True)
            for run in _cut(cores, n + 1)]


def bind_threads(cores: Sequence[int]) -> None:
    """Bind every thread of this process (and so the threads it starts later) to
    `cores`."""
    task_dir = Path("/proc/self/task")
    tids = [int(t.name) for t in task_dir.iterdir()] if task_dir.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, cores)


def cores_of_rank(local_rank: int, masks: Sequence[set[int]],
                  socket_cpus: Sequence[set[int]]) -> list[int] | None:
    """Local rank `local_rank`'s cores given every local rank's affinity mask (in local
    rank order), or None when the launcher pinned the ranks itself (the masks differ)."""
    if any(m != masks[0] for m in masks):
        return None
    return split_cores(masks[0], socket_cpus, len(masks))[local_rank]
