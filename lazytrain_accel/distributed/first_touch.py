"""First-touch placement of the node store's segment: each update group's masters on the
NUMA node (socket) of the local rank that owns the group.

After the segment is sized and before its bytes are reserved (`node_store._create`),
each owner's byte ranges get `mbind(MPOL_PREFERRED, its node)`; for shared memory the
kernel keeps the policy per file range, so the reservation then allocates each page on
its owner's node (no page is written before it). An optimisation, never a failure: one
NUMA node places nothing, a refused `mbind` is one info line. A page two groups share goes
to the first; the header and the generations share the first parameter's page;
`EVERY_RANK` groups keep the default policy (the leader's node).
Docs: docs/user_guide.md "7. Several GPUs" ("Cores per rank").
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger("lazytrain_accel")

#: `mbind`'s system call number per machine (no libnuma dependency).
SYS_MBIND = {"x86_64": 237, "aarch64": 235}
#: linux/mempolicy.h: allocate on this node, else on any other.
MPOL_PREFERRED = 1
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)
_refusal_said = False


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Bytes [offset_bytes, offset_bytes + length_bytes) of the segment, page-aligned,
    preferred on NUMA node `node`."""

    offset_bytes: int
    length_bytes: int
    node: int


def page_placements(spans: Sequence[tuple[int, int, int | None]], *, page_bytes: int
                    ) -> list[Placement]:
    """The page-aligned placements of `spans` ((offset, end, node) in bytes; node None:
    the default policy), in offset order, neighbours on one node merged. A page two spans
    share goes to the first (module docstring)."""
    placements: list[Placement] = []
    unclaimed_page = 0  # the first page no earlier span holds
    for start, end, node in sorted(spans, key=lambda span: span[:2]):
        first = max(start // page_bytes, unclaimed_page)
        last = -(-end // page_bytes)
        if first >= last:
            continue
        unclaimed_page = last
        if node is None:
            continue
        offset, length = first * page_bytes, (last - first) * page_bytes
        previous = placements[-1] if placements else None
        if (previous is not None and previous.node == node
                and previous.offset_bytes + previous.length_bytes == offset):
            placements[-1] = Placement(offset_bytes=previous.offset_bytes,
                                       length_bytes=previous.length_bytes + length, node=node)
        else:
            placements.append(Placement(offset_bytes=offset, length_bytes=length, node=node))
    return placements


def place(fd: int, nbytes: int, placements: Sequence[Placement]) -> bool:
    """Prefer each placement's node for its bytes of the segment `fd` (sized to `nbytes`,
    its pages not yet allocated): whether the kernel took every one. A refusal is said
    once (info) and leaves the rest to the default policy."""
    if not placements:
        return True
    number = SYS_MBIND.get(platform.machine())
    if number is None:
        _say_refused(f"no mbind call number is known for {platform.machine()}")
        return False
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)  # maps, touches no page
    try:
        anchor = ctypes.c_char.from_buffer(mapping)
        base_address = ctypes.addressof(anchor)
        del anchor  # the mapping closes only without exported buffers
        for p in placements:
            error = _mbind(number, base_address + p.offset_bytes, p.length_bytes, p.node)
            if error:
                _say_refused(f"mbind of {p.length_bytes} bytes to node {p.node}: "
                             f"{os.strerror(error)}")
                return False
    finally:
        mapping.close()
    by_node: dict[int, int] = {}
    for p in placements:
        by_node[p.node] = by_node.get(p.node, 0) + p.length_bytes
    logger.info("lazytrain: the node store's pages placed by owner: %s", ", ".join(
        f"node {node} {nbytes / 2**30:.2f} GiB" for node, nbytes in sorted(by_node.items())))
    return True


def _mbind(number: int, address: int, length_bytes: int, node: int) -> int:
    """`mbind(address, length, MPOL_PREFERRED, {node})`: 0, or the errno."""
    mask = (ctypes.c_ulong * (node // _WORD_BITS + 1))()
    mask[node // _WORD_BITS] = 1 << (node % _WORD_BITS)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # every argument a full word: syscall() reads each variadic argument as a long
    result = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address),
                          ctypes.c_ulong(length_bytes), ctypes.c_ulong(MPOL_PREFERRED),
                          mask, ctypes.c_ulong(len(mask) * _WORD_BITS + 1),  # maxnode
                          ctypes.c_ulong(0))
    return ctypes.get_errno() if result != 0 else 0


def _say_refused(why: str) -> None:
    global _refusal_said
    if not _refusal_said:
        _refusal_said = True
        logger.info("lazytrain: the node store's pages are not placed by owner (%s); they "
                    "stay on the local leader's socket, and the other ranks' updates read "
                    "them across the socket link", why)
