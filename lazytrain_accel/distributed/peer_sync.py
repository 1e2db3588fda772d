"""Peer sync: a rank reads a group only once its owner has updated it for the step.

`NodePeers` is the engine's `PeerUpdates` (`engine/step/coordinator.py`) under the node
store: the owner of group g raises `generations[g]` after updating it (a release store),
every other local rank polls it with acquire loads (`GenerationWords`) until it reaches
the number of applied steps. A waiter checks every `LIVENESS_CHECK_S` that the owner's
process still runs, so a dead owner is named within a second, and gives up on a live one
after `OWNER_WAIT_TIMEOUT_S`. A failed collective is restated naming the dead ranks, of
this node or of another on the same host (`named_failure`).
Design: docs/architecture.md "Several ranks on a node" ("Waits").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from lazytrain_accel.distributed import ranks
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.distributed.node_store import pid_alive
from lazytrain_accel.planning.node import EVERY_RANK

#: Longest sleep between two polls of a peer's generation.
_POLL_MAX_S = 1e-3
#: A live peer's update taking longer than this is taken for a hung rank.
OWNER_WAIT_TIMEOUT_S = 1800.0
#: How often a waiter checks that the owner it waits for still runs.
LIVENESS_CHECK_S = 0.5
#: How long a failed collective looks for the death of a peer that caused it.
DEATH_GRACE_S = 1.0


def _poll_until(ready: Callable[[], bool], check: Callable[[], None]) -> None:
    """Poll `ready()` with a growing sleep (10 us up to `_POLL_MAX_S`), calling `check()`
    (which raises to give up) every `LIVENESS_CHECK_S`."""
    sleep_s, checked = 1e-5, time.monotonic()
    while not ready():
        if time.monotonic() - checked > LIVENESS_CHECK_S:
            checked = time.monotonic()
            check()
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, _POLL_MAX_S)


class PeerDiedError(RuntimeError):
    """A rank this one waited for has died (named in the message)."""


@dataclass(frozen=True)
class RemoteRank:
    """A rank of another node: where it runs, so a failure can name it."""

    rank: int
    node: int
    local_rank: int
    host: str
    pid: int


class NodePeers:
    """This node's other local ranks as the engine's `PeerUpdates` sees them
    (`engine/step/coordinator.py`, a Protocol): per-group update generations in the node
    store, written by owners, read by all."""

    def __init__(self, generations: GenerationWords, owners: Sequence[int], rank: int, *,
                 pids: Sequence[int], others: Sequence[RemoteRank] = ()) -> None:
        self._generations = generations  # in the node store, shared by the local ranks
        self._owners = list(owners)
        self._rank = rank
        self._pids = list(pids)  # of each local rank
        self._others = list(others)  # the other nodes' ranks (several nodes)
        self._applied = 0  # steps applied so far (every rank skips the same steps)

    def owns(self, group: int) -> bool:
        return self._owners[group] in (self._rank, EVERY_RANK)

    @property
    def foreign_groups(self) -> list[int]:
        return [g for g in range(len(self._owners)) if not self.owns(g)]

    def begin_step(self) -> None:
        """An applied (not skipped) step begins: every group's next read needs it."""
        self._applied += 1

    def publish(self, group: int) -> None:
        """This rank has updated `group` (owned) for the current step: called after the
        group's writes, on the thread that made them or one that joined it."""
        if self._owners[group] == self._rank:
            self._generations.publish(group, self._applied)

    def publish_all(self) -> None:
        for g in range(len(self._owners)):
            self.publish(g)

    def is_ready(self, group: int) -> bool:
        """Whether `group` may be read now (an acquire load: when True, its owner's
        writes of this step are visible to this thread)."""
        return self.owns(group) or self._generations.read(group) >= self._applied

    def wait(self, group: int) -> None:
        """Block until `group`'s owner has updated it for every applied step; raise
        naming the owner when its process is gone or it hangs."""
        if self.is_ready(group):  # the usual case: no closure, no clock
            return
        start = time.monotonic()

        def check_owner() -> None:
            owner = self._owners[group]
            if not pid_alive(self._pids[owner]):
                raise RuntimeError(
                    f"local rank {owner} (pid {self._pids[owner]}) died while this rank "
                    f"(rank {self._rank}) waited for its update of parameter group "
                    f"{group}; stopping (see rank {owner}'s log and the launcher's "
                    "report; resume from the last checkpoint)")
            if time.monotonic() - start > OWNER_WAIT_TIMEOUT_S:
                raise RuntimeError(
                    f"local rank {owner} (pid {self._pids[owner]}) has not updated "
                    f"parameter group {group} for {OWNER_WAIT_TIMEOUT_S:.0f} s and still "
                    "runs: it hangs (see its log)")

        _poll_until(lambda: self.is_ready(group), check_owner)

    def wait_all(self) -> None:
        for g in range(len(self._owners)):
            self.wait(g)

    def wait_work(self, work: dist.Work) -> None:
        """Wait for a collective of this launch, checking every `LIVENESS_CHECK_S` that the
        ranks it could be waiting for still run: a dead one (of this node, or of another
        on this host) is named within a second (gloo waits on a peer whose socket a hung
        survivor keeps open); its own error restated by `named_failure`."""
        def check_peers() -> None:
            if dead := self._dead():
                raise PeerDiedError(self._died(dead))

        try:
            _poll_until(work.is_completed, check_peers)
            work.wait()
        except PeerDiedError as err:
            ranks.note_peer_failure(str(err))
            raise
        except RuntimeError as err:
            named = self.named_failure(err)
            ranks.note_peer_failure(str(named))
            raise named from err

    def _dead(self) -> list[str]:
        """The ranks of this launch on this host whose process is gone, named."""
        dead = [f"local rank {r} (pid {pid})" for r, pid in enumerate(self._pids)
                if not pid_alive(pid)]
        here = os.uname().nodename
        return dead + [ranks.rank_name(o.rank, node=o.node, local_rank=o.local_rank, pid=o.pid)
                       for o in self._others if o.host == here and not pid_alive(o.pid)]

    def _died(self, dead: list[str]) -> str:
        return (f"{', '.join(dead)} died mid-step; local rank {self._rank} stops (see the "
                "launcher's report; resume from the last checkpoint)")

    def named_failure(self, err: RuntimeError) -> RuntimeError:
        """`err` of a collective, restated naming the local ranks whose process is gone
        (gloo says only "connection reset by peer"); `err` itself when all run. A peer
        killed this instant resets its sockets before its process is gone (the kernel
        closes its files first), so its death is looked for during `DEATH_GRACE_S`."""
        dead, deadline = self._dead(), time.monotonic() + DEATH_GRACE_S
        while not dead and time.monotonic() < deadline:
            time.sleep(0.02)
            dead = self._dead()
        here = os.uname().nodename
        if dead:
            return RuntimeError(f"{self._died(dead)}: {err}")
        if any(o.host != here for o in self._others):  # whose pids cannot be seen here
            nodes = sorted({o.node for o in self._others})
            return RuntimeError(f"a collective with the other nodes ({nodes}) failed: a rank "
                                "there may have stopped (see their launchers' reports); "
                                f"local rank {self._rank} stops: {err}")
        return err
