"""Handing the node store's segment descriptor from the local leader to the other local ranks.

The segment has no name (`os.memfd_create`, or a file unlinked as soon as it is created),
so the other ranks cannot open it: the leader passes the open descriptor itself over a
Unix socket (`SCM_RIGHTS`). The kernel frees the pages when the last process holding the
descriptor or a mapping exits, whatever kills it.

The socket lives in Linux's abstract namespace: no file to leave behind, none another user
could create first with other permissions. Another user may still bind the name first, so
each side checks the other's uid (`SO_PEERCRED`) and refuses a peer that is not this user:
a follower never maps a segment from a stranger, the leader never hands ours to one.
"""

from __future__ import annotations

import os
import socket
import struct

#: A follower connects only after the leader's fill (a barrier orders them), so both
#: sides wait only for a live peer's next system call; past this, one of them is hung.
HANDOFF_TIMEOUT_S = 120.0
_MESSAGE = b"lazytrain-node-store"


class ForeignPeerError(RuntimeError):
    """The other end of the handoff socket runs as another user."""


def _address(name: str) -> str:
    return "\0" + name  # a leading NUL: the abstract namespace, no file


def listen(name: str, *, backlog: int) -> socket.socket:
    """The leader's listening socket under `name`; bound before the followers look for it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_address(name))
    except OSError as err:
        listener.close()
        raise RuntimeError(f"the node store's handoff socket @{name} is taken "
                           f"({err.strerror}): another job on this host has this job's id, "
                           "or another user took the name; give this job another "
                           "MASTER_PORT or run id") from None
    listener.listen(backlog)
    listener.settimeout(HANDOFF_TIMEOUT_S)
    return listener


def serve(listener: socket.socket, fd: int, *, followers: int) -> None:
    """Send `fd` to `followers` connecting ranks of this user, one each."""
    for served in range(followers):
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            raise RuntimeError(f"{followers - served} of the {followers} other local ranks "
                               f"did not ask for the node store within {HANDOFF_TIMEOUT_S:.0f} "
                               "s of the fill (see their errors)") from None
        with conn:
            _check_peer(conn, "a rank asking for the node store")
            socket.send_fds(conn, [_MESSAGE], [fd])


def receive(name: str) -> int:
    """A follower's copy of the leader's segment descriptor (the caller closes it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(HANDOFF_TIMEOUT_S)
        try:
            conn.connect(_address(name))
        except OSError as err:
            raise RuntimeError(f"the local leader's node store socket @{name} cannot be "
                               f"reached ({err.strerror}); the leader failed before "
                               "filling it (see local rank 0's error)") from None
        _check_peer(conn, "the process serving the node store")
        message, fds, _, _ = socket.recv_fds(conn, len(_MESSAGE), 1)
    if message != _MESSAGE or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise RuntimeError(f"the node store socket @{name} answered {message!r} with "
                           f"{len(fds)} descriptors, not the leader's segment; restart "
                           "the job")
    return fds[0]


def _check_peer(conn: socket.socket, who: str) -> None:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        raise ForeignPeerError(f"{who} (pid {pid}) runs as uid {uid}, not as this user "
                               f"({os.geteuid()}): refusing to share the weights with it; "
                               "give this job another MASTER_PORT or run id")
