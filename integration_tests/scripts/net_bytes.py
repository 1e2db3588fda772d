"""The bytes a process has sent over TCP to a set of other processes, from the kernel's
own per-socket count (`ss -tinp`: tcp_info's bytes_acked, each connection's payload that
the peer acknowledged, gloo's included; bytes_sent would count a retransmission twice):
how the simulated-nodes runs measure what crosses from one node to another.

Each established socket of this host is listed with the pids that hold it; a socket of
ours whose peer address (ip:port: a port number alone may be bound on two of the host's
addresses, another process's) is a local address of one of `peers` is a connection to
it. A socket
lists every process holding it: one forked but not yet exec'd (any rank's own `ss` call,
all at once after a barrier) holds its parent's sockets for a moment, so each socket
counts for all of its pids, not the first one listed.
"""

from __future__ import annotations

import re
import shutil
import subprocess

_ENTRY = re.compile(r"^\S+\s+\S+\s+(\S+:\d+)\s+(\S+:\d+)\s+users:(.*)$")
_PID = re.compile(r"pid=(\d+)")
_SENT = re.compile(r"\bbytes_acked:(\d+)")


def available() -> bool:
    return shutil.which("ss") is not None


def bytes_sent_to(pid: int, peers: set[int]) -> int:
    """What process `pid` has sent, so far, on its open TCP connections to `peers` (and
    they acknowledged)."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    # (local address, peer address, the pids holding it, bytes sent and acknowledged):
    # whole addresses, since one port number may be bound on two of the host's addresses
    sockets: list[tuple[str, str, frozenset[int], int]] = []
    entry: tuple[str, str, frozenset[int]] | None = None
    for line in out.splitlines():
        m = _ENTRY.match(line)
        if m:
            entry = (m[1], m[2], frozenset(int(p) for p in _PID.findall(m[3])))
            continue
        sent = _SENT.search(line)
        if entry is not None and sent:
            sockets.append((*entry, int(sent[1])))
            entry = None
    holders = {local: who for local, _, who, _ in sockets}
    return sum(sent for _, peer, who, sent in sockets
               if pid in who and holders.get(peer, frozenset()) & peers)
