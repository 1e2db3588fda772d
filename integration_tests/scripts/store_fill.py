"""Jobs that only build a node store, for killing during the fill (issue 30).

This process imports torch and the package once (seconds on a loaded machine), then for
each line `NAME FILLING` on stdin forks a job and prints its pid: a launcher in a session
of its own that starts two local ranks as its children, each in a session of its own
(torch's launcher does the same), and waits for them. Each rank builds a model of
`--mib` MiB of fp32 parameters (1 MiB each) and calls `node_store.share_model`; the
leader's fill is slowed on purpose (`--param-delay-s` after each parameter), and it
touches FILLING once the first parameter is in the segment, so a test can SIGKILL the
whole job mid-fill. Nothing here cleans up: what the kill leaves is what a job leaves.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path

import torch
from job_server import serve_jobs
from torch import nn

from lazytrain_accel.distributed import node_store


def slowed_fill(delay_s: float, filling: Path) -> None:
    """Copy one parameter at a time, `delay_s` apart; mark the file after the first."""
    copy_all = node_store._point_into

    def one_by_one(store: node_store.NodeStore, params: Sequence, slots: Sequence,
                   copy_slots: Mapping, elsewhere: node_store.Elsewhere | None, *,
                   copy: bool) -> None:
        copy_all(store, [], [], copy_slots, elsewhere, copy=copy)  # (none held elsewhere)
        for param, slot in zip(params, slots, strict=True):
            copy_all(store, [param], [slot], {}, None, copy=copy)
            if copy:
                filling.touch()
                time.sleep(delay_s)

    node_store._point_into = one_by_one


def rank(local_rank: int, args: argparse.Namespace, name: str, filling: str,
         barrier: Barrier) -> None:
    os.setsid()
    model = nn.ParameterList(nn.Parameter(torch.ones(2**18)) for _ in range(args.mib))
    if local_rank == 0:
        slowed_fill(args.param_delay_s, Path(filling))
    node_store.share_model(model, name=name, leader=local_rank == 0, local_ranks=2,
                           num_groups=1, agree=lambda error: barrier.wait())
    time.sleep(600)  # never reached by a test: it kills the job first


def launch(args: argparse.Namespace, name: str, filling: str) -> None:
    """The launcher: two ranks, waited for."""
    os.setsid()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    ranks = [context.Process(target=rank, args=(r, args, name, filling, barrier))
             for r in range(2)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--param-delay-s", type=float, default=0.05)
    args = p.parse_args()
    node_store.shared_params(nn.Linear(1, 1))  # imports what the ranks need, once
    serve_jobs(lambda words: launch(args, *words))


if __name__ == "__main__":
    main()
