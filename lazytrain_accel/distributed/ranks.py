"""What the ranks of a multi-process launch must share, checked at `prepare`, and how they
leave together at exit.

* Agreement: every rank builds its own model, and rank 0 plans for all (`from_first`), so
  a rank given another model or another plugin option would train something else than
  the plan says, or have its option silently dropped. `check_ranks_agree` all-gathers a
  fingerprint of the model's parameters, of the plan options and of the plan received,
  and refuses, naming the ranks, when they differ.
* Exit: a script that ends without `accelerator.end_training()` leaves the default process
  group to the interpreter's finalization, where torch.distributed's C++ state is torn
  down after Python's and a rank can abort (SIGABRT, "terminate called without an active
  exception"). `register_exit_teardown` waits for a running update, meets the other ranks
  and destroys the group at `atexit`, before finalization.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import logging
import os
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel import cores
from lazytrain_accel.planning.plan import Plan

logger = logging.getLogger("lazytrain_accel")

#: How long a rank waits at exit for the others before it destroys its group anyway.
EXIT_BARRIER_S = 60

T = TypeVar("T")


def is_multi_process() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_control_groups: dict[int, Any] = {}


def control_group() -> Any:
    """A gloo group beside the default one for this package's own small collectives (the
    profile and plan from rank 0, the shape of a batch, the re-planner's totals). They are
    issued on the training thread while the update's gradient reduce may be in flight on
    the default group from its own thread; in one group the ranks could pair one rank's
    shape with another's gradients. The first call is collective (every rank, at
    `prepare`); later calls return the same group while the default group lives."""
    key = id(dist.group.WORLD)
    if key not in _control_groups:
        _control_groups.clear()
        _control_groups[key] = dist.new_group(backend="gloo")
    return _control_groups[key]


def from_first(make: Callable[[], T]) -> T:
    """`make()` run by global rank 0 alone and received by every rank (one broadcast):
    what one process measures, probes or solves for the whole launch. An exception on rank
    0 is raised on every rank (the same type where it pickles), never left as a hang.
    Every rank calls this; with one process it is `make()`."""
    if not is_multi_process():
        return make()
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", make())
        except Exception as err:  # every rank must leave the broadcast, with the error
            error = err
            box[0] = ("error", _portable(err))
    with _named_failures():
        dist.broadcast_object_list(box, src=0, group=control_group())
    kind, payload = box[0]
    if error is not None:
        raise error
    if kind == "error":
        raise payload from RuntimeError("raised on rank 0, which decides for every rank")
    return payload


def _portable(err: Exception) -> Exception:
    """`err` where it survives pickling (its type and message on the other ranks), else a
    `RuntimeError` carrying its type's name and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # an __init__ that unpickling cannot call: keep the words
        return RuntimeError(f"{type(err).__name__}: {err}")


#: Restates a failed collective's error naming the rank that died (`NodePeers.
#: named_failure`), once the launch's peers are known (`name_failures_with`).
_failure_namer: list[Callable[[RuntimeError], RuntimeError]] = []


def name_failures_with(namer: Callable[[RuntimeError], RuntimeError]) -> None:
    """From now on a collective of this module that fails is raised as `namer(err)`:
    `err` restated naming a rank whose process is gone (then also noted for the exit,
    `note_peer_failure`), or `err` itself when every rank runs."""
    _failure_namer[:] = [namer]


@contextlib.contextmanager
def _named_failures() -> Iterator[None]:
    try:
        yield
    except RuntimeError as err:
        named = _failure_namer[0](err) if _failure_namer else err
        if named is err:
            raise
        note_peer_failure(str(named))
        raise named from err


def gathered(value: T) -> list[T]:
    """Every rank's `value`, in rank order (one all-gather); `[value]` with one process."""
    if not is_multi_process():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    with _named_failures():
        dist.all_gather_object(values, value, group=control_group())
    return values


def rank_name(rank: int, *, node: int | str, local_rank: int | str, pid: int,
              host: str | None = None) -> str:
    """A rank as failure messages name it: "rank R (node N, local rank L[, host H], pid P)"."""
    where = "" if host is None else f"host {host}, "
    return f"rank {rank} (node {node}, local rank {local_rank}, {where}pid {pid})"


def this_rank() -> str:
    """This rank's `rank_name`: its global rank, node (the launcher's node rank), local
    rank, host and pid."""
    return rank_name(global_rank(),
                     node=os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")),
                     local_rank=os.environ.get("LOCAL_RANK", "0"), pid=os.getpid(),
                     host=os.uname().nodename)


class RankFailedError(RuntimeError):
    """A step every rank takes together failed on some rank (named in the message)."""


def raise_if_any_failed(error: Exception | None, doing: str) -> None:
    """Every rank calls this once at the same point with what failed on it (None: nothing):
    when any rank's `error` is not None, every rank raises one `RankFailedError` naming
    each failed rank and its error, so a failure on one node stops every node at once
    with its name (one all-gather), never a hang in the next collective."""
    failure = None if error is None else (this_rank(), f"{type(error).__name__}: {error}")
    failed = [f for f in gathered(failure) if f is not None]
    if failed:
        named = "; ".join(f"{where} could not {doing}: {what}" for where, what in failed)
        raise RankFailedError(f"{named}. Every rank of the launch stops here; fix that "
                              "rank's setting and relaunch") from error


def agreed_max(values: list[int]) -> list[int]:
    """The element-wise largest of every rank's `values` (one all-reduce of a small CPU
    tensor): a shape every rank then plans for alike. `values` with one process."""
    if not is_multi_process():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    with _named_failures():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=control_group())
    return [int(v) for v in tensor.tolist()]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


#: The plugin options a plan is made from that every rank must give alike: rank 0 plans
#: with its own, so another value on another rank would be silently dropped. Budgets are
#: not here (each rank's counts: the plan is made for the least, `run/shared.py`), nor the
#: batch shape (the largest any rank sizes, `run/state.py`).
PLAN_OPTIONS = ("plan", "hardware", "optimizer", "max_recompute_block", "loss_chunk_tokens",
                "resident_update", "frozen_weights", "node_store", "replan")


def global_rank() -> int:
    return dist.get_rank() if is_multi_process() else 0


def plan_digest(plan: Plan) -> str:
    """A short fingerprint of `plan`'s decisions (what `check_ranks_agree` compares)."""
    return _digest(_decisions(plan))


def _decisions(plan: Plan) -> dict[str, Any]:
    return {"run": plan.fingerprint, "strategy": plan.strategy,
            "homes": [h.value for h in plan.homes], "optimizer": plan.optimizer,
            "resident_update": plan.resident_update,
            "loss_chunk_tokens": plan.loss_chunk_tokens, "tiling": plan.tiling,
            "tile_tokens": plan.tile_tokens, "gpus_per_node": plan.gpus_per_node,
            "nodes": plan.nodes}


def rank_key(plan: Plan, model: nn.Module, options: dict[str, Any]) -> dict[str, str]:
    """This rank's fingerprints: the model (parameter names, shapes, dtypes, trainability),
    the plugin `options` a plan is made from (`PLAN_OPTIONS`), and the plan's decisions
    (run fingerprint, strategy, homes, optimizer, tiling, node shape)."""
    params = [[n, list(p.shape), str(p.dtype), p.requires_grad]
              for n, p in model.named_parameters()]
    return {"model": _digest(params), "plan options": _digest(options),
            "plan": plan_digest(plan),
            "plan options_summary": ", ".join(f"{k}={v}" for k, v in options.items()),
            "plan_summary": f"{plan.strategy}, homes {plan.count_homes()}, optimizer "
                            f"{plan.optimizer}"}


def check_ranks_agree(plan: Plan, model: nn.Module, options: dict[str, Any]) -> None:
    """Raise `ValueError` at prepare when the launch's ranks differ in model, in the plugin
    options a plan is made from, or in the plan they received."""
    if not is_multi_process():
        return
    keys = gathered(rank_key(plan, model, options))
    for what in ("model", "plan options", "plan"):
        ranks: dict[str, list[int]] = {}
        for rank, key in enumerate(keys):
            ranks.setdefault(key[what], []).append(rank)
        if len(ranks) > 1:
            summary = f"{what}_summary"
            sides = "; ".join(f"ranks {r}: {what} {digest}" + (
                f" ({keys[r[0]][summary]})" if summary in keys[r[0]] else "")
                for digest, r in ranks.items())
            raise ValueError(
                f"the ranks of this launch disagree on the {what} ({sides}): every rank must "
                "build the same model and pass the same LazyTrainPlugin options and "
                "LAZYTRAIN_* environment (plan, optimizer, hardware), so that all stream "
                "one plan")


def least(value: int) -> int:
    """The least of every rank's `value` (one all-gather): a figure each rank reads on its
    own (free host memory) made the same on all, so they decide alike."""
    return min(gathered(int(value)))


def bind_local_cores(*, local_rank: int, node_id: str) -> list[int] | None:
    """Bind this rank's threads to its share of the node's usable cores
    (`cores.cores_of_rank`: every local rank's affinity mask is all-gathered, keyed by
    `node_id`); the cores, or None when the launcher pinned the ranks itself. Every rank
    calls this."""
    mask = os.sched_getaffinity(0)
    places: list[tuple[str, int, list[int]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(places, (node_id, local_rank, sorted(mask)))
    local = sorted((r, set(m)) for node, r, m in places if node == node_id)
    if [r for r, _ in local] != list(range(len(local))):  # the launcher's numbering is off
        logger.warning("lazytrain: the local ranks of node %r report local ranks %s, not "
                       "0..%d; their cores are left unbound", node_id,
                       [r for r, _ in local], len(local) - 1)
        return None
    chosen = cores.cores_of_rank(local_rank, [m for _, m in local], cores.sockets())
    if chosen is None:
        logger.info("lazytrain: the launcher pinned the local ranks to cores itself; kept")
        return None
    cores.bind_threads(chosen)
    logger.info("lazytrain: local rank %d bound to cores %s", local_rank, chosen)
    return chosen


def local_numa_nodes(*, local_rank: int, node_id: str) -> list[int] | None:
    """Each local rank's NUMA node, in local rank order (`cores.node_of_cores` of its
    affinity, bound or the launcher's), for placing the node store by owner; None on a
    host of one node (nothing to place) or where a rank's node is unknown. Every rank
    calls this (one all-gather, on every host, so no host skips the collective)."""
    topology = cores.numa_nodes()
    mine = (cores.node_of_cores(os.sched_getaffinity(0), topology) if len(topology) > 1
            else None)
    places: list[tuple[str, int, int | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(places, (node_id, local_rank, mine))
    local = sorted((r, n) for node, r, n in places if node == node_id)
    if [r for r, _ in local] != list(range(len(local))) or any(n is None for _, n in local):
        return None
    return [n for _, n in local]


_peer_failures: list[str] = []


def note_peer_failure(why: str) -> None:
    """A collective failed because a rank of the launch died (`peer_sync.NodePeers`):
    the exit then leaves the process group as it is (`_teardown`)."""
    _peer_failures.append(why)


def register_exit_teardown(synchronize: Callable[[], None]) -> None:
    """At interpreter exit: `synchronize` (a bound method, held weakly: wait for a running
    update), then meet the other ranks and destroy the default process group, unless the
    script did (`end_training`)."""
    atexit.register(_teardown, weakref.WeakMethod(synchronize))


def _teardown(synchronize_ref: weakref.WeakMethod) -> None:
    synchronize = synchronize_ref()
    try:
        if synchronize is not None:
            synchronize()
    except RuntimeError as err:  # the script failed (a rank died): still leave the group
        logger.warning("lazytrain: at exit, the update could not be waited for (%s)", err)
    if not (dist.is_available() and dist.is_initialized()):
        return
    if _peer_failures:  # its groups may hold work a dead peer never answers: left as they
        logger.warning("lazytrain: at exit, the process group is left as it is: %s",
                       _peer_failures[0])  # are, the launcher reports the dead rank
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
        else:
            dist.barrier()
    except RuntimeError as err:  # a rank died: leave anyway, it is reported by the launcher
        logger.warning("lazytrain: at exit, the other ranks did not all arrive (%s); "
                       "destroying the process group anyway", err)
    finally:
        dist.destroy_process_group()
