"""The bytes a process has sent over TCP to a set of other processes, from the kernel's
own per-socket count (`ss -tinp`: tcp_info's bytes_sent, each connection's payload, gloo's
included): how the simulated-nodes runs measure what crosses from one node to another.

Each established socket of this host is listed with its owner's pid; a socket of ours
whose peer port is a local port of one of `peers` is a connection to it.
"""

from __future__ import annotations

import re
import shutil
import subprocess

_ENTRY = re.compile(r"^\S+\s+\S+\s+\S+:(\d+)\s+\S+:(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")
_SENT = re.compile(r"\bbytes_sent:(\d+)")


def available() -> bool:
    return shutil.which("ss") is not None


def bytes_sent_to(pid: int, peers: set[int]) -> int:
    """What process `pid` has sent, so far, on its open TCP connections to `peers`."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    sockets: list[tuple[int, int, int, int]] = []  # (local port, peer port, pid, sent)
    entry: tuple[int, int, int] | None = None
    for line in out.splitlines():
        m = _ENTRY.match(line)
        if m:
            entry = (int(m[1]), int(m[2]), int(m[3]))
            continue
        sent = _SENT.search(line)
        if entry is not None and sent:
            sockets.append((*entry, int(sent[1])))
            entry = None
    owner = {local: who for local, _, who, _ in sockets}
    return sum(sent for _, peer, who, sent in sockets if who == pid and owner.get(peer) in peers)
