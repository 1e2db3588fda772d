"""`accelerate launch` of several CPU processes with the node store (issue 22 items 1-2):
one host copy per node, the update split across the ranks, losses as one process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from integration_tests.test_accelerate_launch import (
    ACCELERATE,
    SCRIPT,
    _free_port,
    _launch,
    _run,
)

STEPS = ("--steps", "4", "--lazytrain")
#: The host-bytes runs: big enough layers that the state dominates the runtime.
PSS_ARGS = ("--steps", "3", "--lazytrain", "--plan", "offload_all", "--hidden-size", "512")
#: Freed tensors go back to the system in every run (no malloc arena keeps them).
PSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lazytrain-")}


def _pss_state(directory: Path, name: str, ranks: int) -> int:
    """The training state's host bytes: the ranks' summed PSS at the end of training
    minus each one's runtime (its PSS with the process group and a loader prepared and
    no model built yet; the script measures it first with `--pss-out`) and minus the
    engine's device buffers (on this CPU device, host pages that stand for each GPU's
    memory: its two weight slots)."""
    states = [json.loads((directory / f"{name}_{r}.json").read_text()) for r in range(ranks)]
    return sum(s["end"] - s["runtime"] - s["device"] for s in states)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory
                ) -> Callable[..., tuple[list[float], int]]:
    """The one-process reference on the global batch of 8, launched once per set of
    arguments for the tests of this module: (losses, PSS growth)."""
    runs: dict[tuple[str, ...], tuple[list[float], int]] = {}

    def run(*args: str) -> tuple[list[float], int]:
        if args not in runs:
            directory = tmp_path_factory.mktemp("one")
            losses = _launch(directory, "one", *args, "--batch-size", "8", "--pss-out",
                             str(directory / "one_"), env=PSS_ENV)
            runs[args] = (losses, _pss_state(directory, "one", 1))
        return runs[args]

    return run


@pytest.mark.parametrize(("optimizer", "plan"), [("keep", "checkpoint_all"),
                                                  ("hybrid8bit", "offload_all")])
def test_split_update_equals_the_replicated_one_and_one_process(
        tmp_path: Path, one_process: Callable[..., tuple[list[float], int]], optimizer: str,
        plan: str) -> None:
    args = (*STEPS, "--plan", plan, "--optimizer", optimizer)
    segments = _segments()
    one, _ = one_process(*args)
    split = _launch(tmp_path, "split", *args, "--batch-size", "4", "--state-out",
                    str(tmp_path / "split_"), num_processes=2)
    replicated = _launch(tmp_path, "replicated", *args, "--batch-size", "4", "--state-out",
                         str(tmp_path / "replicated_"), num_processes=2,
                         env={"LAZYTRAIN_NODE_STORE": "off"})
    assert _segments() == segments  # nothing left under /dev/shm
    # The store's ranks planned as one node of 2 (host bytes, bandwidth, the split
    # update); each replicated rank alone.
    for name, ranks in (("split", 2), ("replicated", 1)):
        states = [json.loads((tmp_path / f"{name}_{r}.json").read_text()) for r in (0, 1)]
        assert [s["gpus_per_node"] for s in states] == [ranks, ranks], name
    # The same averaged gradients, the same update math, split or not: bit for bit.
    assert split == replicated
    # One process on the global batch sums the gradients in another order: the first
    # steps agree to fp32 precision; Adam amplifies the 1e-7 differences later (the
    # all-reduce path shows the same ~1e-4, test_accelerate_launch.py).
    assert split[:2] == pytest.approx(one[:2], rel=1e-5)
    assert split == pytest.approx(one, rel=1e-3)


def test_four_processes_match_one_process(
        tmp_path: Path, one_process: Callable[..., tuple[list[float], int]]) -> None:
    args = (*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep")
    one, _ = one_process(*args)
    four = _launch(tmp_path, "four", *args, "--batch-size", "2", num_processes=4)
    assert four[:2] == pytest.approx(one[:2], rel=1e-5)
    assert four == pytest.approx(one, rel=1e-3)


def test_ranks_share_one_copy_of_the_masters(
        tmp_path: Path, one_process: Callable[..., tuple[list[float], int]]) -> None:
    """The training state's host bytes (`_pss_state`: the ranks' summed PSS at the end
    minus each one's runtime and its CPU-"device" weight slots), 2 ranks against one
    process on the global batch (issue 22: at most 1.3x). Measured (hidden 512, 4
    layers, 3 steps, hybrid 8-bit, 2 loaded cores): one 75.9 MB (masters 38.5, moments
    19.2, heap), store 82.9 MB (1.09x: masters and moments once, each rank its heap);
    with the slots counted 94.8 and 96.4-120.7 MB (1.03-1.27x); off about twice one."""
    _, one = one_process(*PSS_ARGS)
    state = {"one": one}
    for name, store in (("store", "auto"), ("off", "off")):
        _launch(tmp_path, name, *PSS_ARGS, "--batch-size", "4", "--pss-out",
                str(tmp_path / f"{name}_"), num_processes=2,
                env={**PSS_ENV, "LAZYTRAIN_NODE_STORE": store})
        state[name] = _pss_state(tmp_path, name, 2)
    assert state["store"] <= 1.3 * state["one"], state
    assert state["store"] < state["off"], state


def test_a_rank_killed_mid_step_stops_the_others_naming_it(tmp_path: Path) -> None:
    """kill -9 of rank 1 between its backward and its update (step 2): the launch ends
    non-zero within 60 s of the kill, the report names rank 1, no segment is left."""
    segments = _segments()
    losses = tmp_path / "killed.json"
    proc = _run(tmp_path, "--losses", str(losses), "--steps", "6", "--lazytrain", "--plan",
                "checkpoint_all", "--batch-size", "4", "--kill-rank", "1", "--kill-step",
                "2", num_processes=2)
    ended = time.time()
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0, report[-4000:]
    killed_at = float(Path(f"{losses}.killed_at").read_text())
    assert ended - killed_at < 60, (ended - killed_at, report[-4000:])
    assert re.search(r"rank\s*:\s*1\b|local rank 1\b", report), report[-4000:]
    assert _segments() == segments


def _launch_nodes(tmp_path: Path, name: str, *script_args: str, nodes: int = 2,
                  ranks_per_node: int = 2, env: dict[str, str] | None = None) -> list[float]:
    """`nodes` simulated nodes on this host: one `accelerate launch --num_machines K
    --machine_rank r` per node (torchrun's static rendezvous on 127.0.0.1), run side by
    side; each node's ranks get GROUP_RANK r, so each node maps its own segment."""
    losses = tmp_path / f"{name}.json"
    port = str(_free_port())
    full_env = {**os.environ, "LAZYTRAIN_CACHE_DIR": str(tmp_path / "cache"),
                "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_NVME_DIR": str(tmp_path / "nvme"),
                **(env or {})}
    procs = [subprocess.Popen(
        [*ACCELERATE, "--multi_gpu", "--num_machines", str(nodes), "--machine_rank", str(r),
         "--num_processes", str(nodes * ranks_per_node), "--main_process_ip", "127.0.0.1",
         "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no",
         str(SCRIPT), "--cpu", "--losses", str(losses), *script_args],
        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(nodes)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {r}:\n{out[-6000:]}"
    return json.loads(losses.read_text())


@pytest.mark.parametrize("optimizer", ["keep", "hybrid8bit"])
def test_two_nodes_of_two_ranks(tmp_path: Path,
                                one_process: Callable[..., tuple[list[float], int]],
                                optimizer: str) -> None:
    """Two simulated nodes x 2 ranks on this host (issue 22 item 3): each node maps its
    own copy, each share is reduced within the node to its owner, then across the two
    nodes' owners of it, and both owners apply the same update, so the four ranks end
    with the same weights bit for bit; the losses are those of one process on the global
    batch to 1e-5 over the first two steps. After that the summation order shows: keep
    (hidden 64) 3e-4 at step 3; hybrid8bit (hidden 512), whose 8-bit moments turn 1e-7
    differences into other codes, 6.8e-3 (one node of 2 ranks: 2.2e-3). The hybrid run
    also measures the state (`_pss_state`): the four ranks' at most 2.6x one process's
    (measured 2.22x: a copy per node, each rank its heap; 2.54-2.74x with each rank's
    CPU-"device" weight slots counted)."""
    segments = _segments()
    args, later = (((*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep"), 1e-3)
                   if optimizer == "keep" else (PSS_ARGS, 2e-2))
    one, one_state = one_process(*args)
    nodes = _launch_nodes(tmp_path, "nodes", *args, "--batch-size", "2", "--state-out",
                          str(tmp_path / "nodes_"), "--pss-out", str(tmp_path / "pss_"),
                          env=PSS_ENV)
    assert _segments() == segments
    states = [json.loads((tmp_path / f"nodes_{r}.json").read_text()) for r in range(4)]
    assert [s["gpus_per_node"] for s in states] == [2] * 4  # a node store per node
    assert len({s["weights_sum"] for s in states}) == 1, states  # the nodes' copies agree
    assert nodes[:2] == pytest.approx(one[:2], rel=1e-5)
    assert nodes == pytest.approx(one, rel=later)
    if optimizer == "hybrid8bit":
        state = _pss_state(tmp_path, "pss", 4)
        assert state <= 2.6 * one_state, (state, one_state)
