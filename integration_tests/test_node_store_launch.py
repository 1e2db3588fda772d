"""`accelerate launch` of several CPU processes with the node store (issue 22 items 1-2):
one host copy per node, the update split across the ranks, losses as one process."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from integration_tests.test_accelerate_launch import (
    ACCELERATE,
    SCRIPT,
    _free_port,
    _launch,
    _run,
)
from lazytrain_accel.cores import parse_cpulist
from lazytrain_accel.planning.node import network_bytes_per_step

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


def _net_per_step(directory: Path, ranks: int
                  ) -> tuple[dict[str, float], int, list[list[int]]]:
    """Per node, what its ranks sent to the other nodes per step, over the steps after
    the first (which holds the launch's own setup); the trainable parameters; and each
    rank's running count after each step (what a failure shows)."""
    records = [json.loads((directory / f"net_{r}.json").read_text()) for r in range(ranks)]
    per_node: dict[str, float] = {}
    for rec in records:
        sent = rec["sent"]
        per_node[rec["node"]] = per_node.get(rec["node"], 0.0) + (
            (sent[-1] - sent[0]) / (len(sent) - 1))
    return per_node, records[0]["params"], [rec["sent"] for rec in records]


@dataclass(frozen=True)
class Run:
    """One launch's record: the logged losses (the global batch's mean per step), the
    sequences each step trained on, every rank's weights digest and `--state-out`
    record, and the training state's host bytes (`_pss_state`)."""

    losses: list[float]
    samples: list[list[int]]
    weights: list[str]
    states: list[dict]
    pss_state: int
    #: per node, the TCP bytes its ranks sent to the other nodes' per step after the
    #: first, and the trainable parameters (simulated nodes only: `--net-out`)
    net_per_step: dict[str, float] | None = None
    params: int = 0
    net_sent: list[list[int]] | None = None  # each rank's running count, after each step


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """`launch(*args, processes=P, micro_batches=M, store=...)`: P ranks, each
    accumulating M micro-batches of 8 // (P * M) sequences per step (the global batch is
    8 in every run), once per module for each set of arguments: the one-process
    references and the two-rank runs are shared by the tests that compare them."""
    runs: dict[tuple, Run] = {}

    def run(*args: str, processes: int = 1, micro_batches: int = 1, store: str = "auto",
            nodes: int = 1, layout: str = "replicated") -> Run:
        key = (args, processes, micro_batches, store, nodes, layout)
        if key not in runs:
            d = tmp_path_factory.mktemp(f"p{processes}m{micro_batches}{store}{layout}")
            outputs = ("--batch-size", str(8 // (processes * micro_batches)),
                       "--grad-accum", str(micro_batches), "--state-out", str(d / "state_"),
                       "--digest-out", str(d / "digest_"), "--pss-out", str(d / "pss_"),
                       "--samples-out", str(d / "samples.json"))
            # threads=0 as a user's launch has it (tests/conftest.py sets
            # LAZYTRAIN_THREADS for the in-process tests, and an explicit count would
            # leave the ranks' cores unbound): each rank gets its cores' share. One process
            # accumulating M micro-batches stands for M ranks: it runs at one rank's
            # share, since a GEMM's sums may split by threads (MKL on a Xeon with AMX gave
            # 2e-7 apart at 2 threads against 1; the AVX-512 Zen 5 did not)
            threads = max(1, len(os.sched_getaffinity(0)) // micro_batches) \
                if processes == 1 else 0
            env = {**PSS_ENV, "LAZYTRAIN_NODE_STORE": store, "LAZYTRAIN_THREADS": str(threads),
                   "LAZYTRAIN_NODE_LAYOUT": layout}
            net: dict[str, float] | None = None
            params, sent = 0, None
            if nodes == 1:
                losses = _launch(d, "run", *args, *outputs, num_processes=processes, env=env)
            else:
                losses = _launch_nodes(d, "run", *args, *outputs, "--net-out", str(d / "net_"),
                                       nodes=nodes, ranks_per_node=processes // nodes,
                                       env=env)
                if (d / "net_0.json").is_file():  # `ss` (iproute2) was there to count
                    net, params, sent = _net_per_step(d, processes)
            runs[key] = Run(
                losses=losses, samples=json.loads((d / "samples.json").read_text()),
                weights=[json.loads((d / f"digest_{r}.json").read_text())["weights"]
                         for r in range(processes)],
                states=[json.loads((d / f"state_{r}.json").read_text())
                        for r in range(processes)],
                pss_state=_pss_state(d, "pss", processes), net_per_step=net, params=params,
                net_sent=sent)
        return runs[key]

    return run


def _assert_equal_to_accumulation(ranks: Run, one: Run) -> None:
    """N ranks of batch B equal one process accumulating N micro-batches of B on the
    same sequences, bit for bit: losses at every step and the final weights."""
    assert ranks.samples == one.samples  # rank r's batch is micro-batch r of the step
    assert ranks.losses == one.losses
    assert set(ranks.weights) == {one.weights[0]}


@pytest.mark.parametrize("optimizer", ["keep", "hybrid8bit"])
def test_split_update_equals_one_process_accumulating_the_global_batch(
        launch: Callable[..., Run], optimizer: str) -> None:
    """2 ranks x batch 4 under the node store (the split update), the same 2 ranks
    replicated (LAZYTRAIN_NODE_STORE=off: all-reduce), and one process accumulating 2
    micro-batches of 4: the same sequences per step, the same losses and final weights,
    bit for bit. Why exact: accelerate's backward scales an accumulating loss by 1/2 and
    the ranks' mean divides the summed gradients by 2, both exact in fp32 (a power of
    two), and a + b is b + a; the clip coefficient is one process's because the global
    norm is combined in one process's order (`ShareReducer.gather`). One process on a
    batch of 8 instead sums each GEMM over 8 samples at once: 1e-7 to 2e-7 apart
    (test_accelerate_launch.py compares that run). keep: the small
    model; hybrid8bit: the host-bytes model (hidden 512), shared with the PSS test."""
    args = ((*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep")
            if optimizer == "keep" else PSS_ARGS)
    segments = _segments()
    one = launch(*args, micro_batches=2)
    split = launch(*args, processes=2)
    replicated = launch(*args, processes=2, store="off")
    assert _segments() == segments  # nothing left under /dev/shm
    # The store's ranks planned as one node of 2 (host bytes, bandwidth, the split
    # update); each replicated rank alone.
    assert [s["gpus_per_node"] for s in split.states] == [2, 2]
    assert [s["gpus_per_node"] for s in replicated.states] == [1, 1]
    _assert_equal_to_accumulation(split, one)
    _assert_equal_to_accumulation(replicated, one)


def test_each_rank_is_bound_to_cores_of_its_own(launch: Callable[..., Run]) -> None:
    """The parity test's 2-rank store launch: every thread of a rank has one
    `Cpus_allowed_list` (/proc/<pid>/task/*/status), the ranks' sets are disjoint and
    cover the launcher's usable cores; with `node_store="off"` the ranks are bound too
    (binding is per local rank, not per store)."""
    usable = os.sched_getaffinity(0)
    args = (*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep")
    for run in (launch(*args, processes=2), launch(*args, processes=2, store="off")):
        per_rank = [s["cpus_allowed"] for s in run.states]
        assert all(len(lists) == 1 for lists in per_rank), per_rank
        sets = [parse_cpulist(lists[0]) for lists in per_rank]
        if len(usable) >= 2:
            assert not sets[0] & sets[1], sets
        assert sets[0] | sets[1] == usable, (sets, usable)


def test_four_processes_match_one_process(launch: Callable[..., Run]) -> None:
    """4 ranks x batch 2 against one process accumulating 4 micro-batches of 2: the same
    sequences; gloo sums the 4 ranks' gradients (and the logged losses) in its own order
    ((a + b) + (c + d), or ring chunks), not the accumulation's ((a + b) + c) + d, so the
    weights differ in their last bits. Measured (keep, 4 steps): losses 1.0e-7 apart
    (one fp32 ulp) at steps 1, 2 and 4, equal at step 3."""
    args = (*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep")
    one = launch(*args, micro_batches=4)
    four = launch(*args, processes=4)
    assert four.samples == one.samples
    assert four.losses == pytest.approx(one.losses, rel=1e-6)


def test_ranks_share_one_copy_of_the_masters(launch: Callable[..., Run]) -> None:
    """The training state's host bytes (`_pss_state`: the ranks' summed PSS at the end
    minus each one's runtime and its CPU-"device" weight slots), 2 ranks against one
    process accumulating the global batch in 2 micro-batches (issue 22: at most 1.3x).
    Measured (hidden 512, 4 layers, 3 steps, hybrid 8-bit, 2 loaded cores): one 83.8 MB
    (masters 38.5, moments 19.2, heap), store 92.6 MB (1.10x: masters and moments once,
    each rank its heap), off 147.8 MB (1.76x). The launches are the parity test's
    (`launch` runs each once)."""
    one = launch(*PSS_ARGS, micro_batches=2).pss_state
    store = launch(*PSS_ARGS, processes=2).pss_state
    off = launch(*PSS_ARGS, processes=2, store="off").pss_state
    assert store <= 1.3 * one, (store, one, off)
    assert store < off, (store, one, off)


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


#: A container's /dev/shm: a 32 MiB tmpfs in a mount namespace of the launch's own (root).
SMALL_SHM = ("unshare", "--mount", "sh", "-c",
             'mount -t tmpfs -o size=32m tmpfs /dev/shm && exec "$@"', "small-shm")


def _small_shm_unavailable() -> str | None:
    """Why a launch cannot get a 32 MiB /dev/shm here, or None."""
    try:
        probe = subprocess.run([*SMALL_SHM, "true"], capture_output=True, text=True,
                               timeout=60)
    except FileNotFoundError:
        return "no unshare(1) on this host"
    return None if probe.returncode == 0 else (
        f"cannot mount a tmpfs on /dev/shm in a mount namespace: {probe.stderr.strip()}")


def test_a_small_dev_shm_trains_as_one_process(launch: Callable[..., Run],
                                               tmp_path: Path) -> None:
    """Two ranks in a container's 32 MiB /dev/shm, the host-bytes model's store ~40 MB
    (issue 30). The default anonymous segment (memfd) does not live there: it shares one
    copy and warns of nothing. node_store_dir=/dev/shm cannot hold it: each rank keeps its
    own copy, with one warning naming the bytes and the fix. Both exit 0 on every rank
    and log the losses of one process accumulating the global batch, bit for bit (that
    run is the parity test's, at one rank's share of the cores: the ranks take theirs,
    threads=0, as `launch` runs them)."""
    why = _small_shm_unavailable()
    if why is not None:
        pytest.skip(why)
    one = launch(*PSS_ARGS, micro_batches=2)
    for store_dir, node_ranks, warnings in (("memfd", 2, 0), ("/dev/shm", 1, 1)):
        d = tmp_path / store_dir.strip("/").replace("/", "_")
        d.mkdir()
        proc = _run(d, "--losses", str(d / "losses.json"), *PSS_ARGS, "--batch-size", "4",
                    "--state-out", str(d / "state_"), num_processes=2, prefix=SMALL_SHM,
                    env={"LAZYTRAIN_NODE_STORE_DIR": store_dir, "LAZYTRAIN_THREADS": "0"})
        report = proc.stdout + proc.stderr
        assert proc.returncode == 0, report[-6000:]
        warned = [line for line in report.splitlines() if line.startswith("lazytrain: ")]
        assert len(warned) == warnings, warned
        if warnings:
            for words in ("needs", "in /dev/shm", "GiB free", "--shm-size=", "node_store_dir"):
                assert words in warned[0], warned[0]
        states = [json.loads((d / f"state_{r}.json").read_text()) for r in range(2)]
        assert [s["gpus_per_node"] for s in states] == [node_ranks] * 2
        assert json.loads((d / "losses.json").read_text()) == one.losses


def _start_nodes(tmp_path: Path, losses: Path, *script_args: str, nodes: int = 2,
                 ranks_per_node: int = 2, env: dict[str, str] | None = None,
                 wrap: Callable[[int, list[str]], list[str]] = lambda node, cmd: cmd
                 ) -> list[subprocess.Popen]:
    """`nodes` simulated nodes on this host, started side by side: one `accelerate launch
    --num_machines K --machine_rank r` per node (torchrun's static rendezvous on
    127.0.0.1); each node's ranks get GROUP_RANK r, so each node maps its own segment.
    `wrap(r, command)`: node r's command as run (another namespace, another setting)."""
    port = str(_free_port())
    full_env = {**os.environ, "LAZYTRAIN_CACHE_DIR": str(tmp_path / "cache"),
                "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_NVME_DIR": str(tmp_path / "nvme"),
                **(env or {})}
    return [subprocess.Popen(wrap(r, [
        *ACCELERATE, "--multi_gpu", "--num_machines", str(nodes), "--machine_rank", str(r),
        "--num_processes", str(nodes * ranks_per_node), "--main_process_ip", "127.0.0.1",
        "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no",
        str(SCRIPT), "--cpu", "--losses", str(losses), *script_args]),
        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(nodes)]


def _launch_nodes(tmp_path: Path, name: str, *script_args: str, nodes: int = 2,
                  ranks_per_node: int = 2, env: dict[str, str] | None = None) -> list[float]:
    """`_start_nodes`, each node's launch to exit 0: the losses."""
    losses = tmp_path / f"{name}.json"
    procs = _start_nodes(tmp_path, losses, *script_args, nodes=nodes,
                         ranks_per_node=ranks_per_node, env=env)
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {r}:\n{out[-6000:]}"
    return json.loads(losses.read_text())


@pytest.mark.parametrize("optimizer", ["keep", "hybrid8bit"])
def test_two_nodes_of_two_ranks(launch: Callable[..., Run], optimizer: str) -> None:
    """Two simulated nodes x 2 ranks on this host (issue 22 item 3): each node maps its
    own copy, each share is reduced within the node to its owner, then across the two
    nodes' owners of it, and both owners apply the same update, so the four ranks end
    with the same weights bit for bit. Against one process accumulating 4 micro-batches
    of 2 (the same sequences): the sums run ((a + b) + (c + d)) against the
    accumulation's ((a + b) + c) + d, so the last bits differ; measured, relative loss
    difference per step: keep (4 steps) 9.8e-8, 1.0e-7, 0, 1.0e-7; hybrid8bit (hidden
    512, 3 steps) 0, 0, 7.6e-7 (the issue's 1e-5 and 1e-4 are asserted).
    The hybrid run also measures the state (`_pss_state`): the four ranks' at most 2.6x
    one process's (the accumulating reference's; measured 176.8 MB against 85.0, 2.08x)."""
    segments = _segments()
    args = ((*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep")
            if optimizer == "keep" else PSS_ARGS)
    one = launch(*args, micro_batches=4)
    nodes = launch(*args, processes=4, nodes=2)
    assert _segments() == segments
    assert [s["gpus_per_node"] for s in nodes.states] == [2] * 4  # a node store per node
    assert len(set(nodes.weights)) == 1, nodes.weights  # the nodes' copies agree
    assert nodes.samples == one.samples
    assert nodes.losses == pytest.approx(one.losses, rel=1e-5 if optimizer == "keep" else 1e-4)
    if optimizer == "hybrid8bit":
        assert nodes.pss_state <= 2.6 * one.pss_state, (nodes.pss_state, one.pss_state)
    _assert_network_as_modelled(nodes, "replicated")


def _assert_network_as_modelled(run: Run, layout: str, *, copy_bytes_per_param: int = 4
                                ) -> None:
    """What crossed between the two nodes of `run`, measured (the kernel's count of each
    TCP connection's bytes), within 1.1x of the planner's node model of `layout` (issue
    45); skipped where `ss` could not count."""
    if run.net_per_step is None:
        pytest.skip("`ss` (iproute2) is not installed: the bytes between the nodes were not "
                    "counted (everything else above passed)")
    model = network_bytes_per_step(host_update_params=run.params, every_rank_params=0,
                                   copy_bytes_per_param=copy_bytes_per_param, nodes=2,
                                   layout=layout)
    for node, sent in run.net_per_step.items():
        assert model / 1.1 <= sent <= 1.1 * model, (node, sent, model, run.net_sent)


def test_split_layout_across_two_nodes(launch: Callable[..., Run]) -> None:
    """`node_layout="split"` over 2 simulated nodes x 2 ranks (issue 45): each group is
    updated on one node only, its gradient reduced to that node and its new weights
    broadcast from it. Against the replicated layout (every node updating alike, shared
    with `test_two_nodes_of_two_ranks`): the same losses and final weights, bit for bit
    (two nodes' sums are one addition either way), on every rank; the bytes each node sent
    the other, counted by the kernel, within 1.1x of the node model's split figure, half
    the replicated one's. With the hybrid operator; a torch optimizer (`keep`) in the
    split layout, whose nodes send masters, runs at bf16 in the test below."""
    replicated = launch(*PSS_ARGS, processes=4, nodes=2)
    split = launch(*PSS_ARGS, processes=4, nodes=2, layout="split")
    assert split.samples == replicated.samples
    assert split.losses == replicated.losses
    assert set(split.weights) == {replicated.weights[0]}
    _assert_network_as_modelled(split, "split")


@pytest.mark.parametrize("optimizer", ["hybrid8bit", "keep"])
def test_split_layout_at_bf16_keeps_compute_copies_of_the_other_nodes_layers(
        launch: Callable[..., Run], optimizer: str) -> None:
    """The split layout at bf16 compute (issue 45). With the hybrid operator (which
    writes each layer's compute copy) a node holds the fp32 masters, moments and
    gradients of the layers it updates only, and of the others their bf16 compute copy,
    sent by the node that updates each (placeholders stand for their masters); with a
    torch optimizer (`keep`: no copy written) every node keeps every master and the
    masters are sent. Against the replicated layout at bf16: the same losses and final
    weights (gathered by `accelerator.get_state_dict` on every rank), bit for bit (a
    compute copy is the one cast of the same master either way); the network within
    1.1x of the node model at 2 (4) bytes a parameter for the copies (masters); with the
    hybrid operator (hidden 512) the four ranks' state below the replicated run's (read
    243 against 340 MB; `keep`'s hidden 64 saves 1 MB of about 95, within the noise)."""
    args = ((*PSS_ARGS, "--mixed-precision", "bf16") if optimizer == "hybrid8bit" else
            (*STEPS, "--plan", "checkpoint_all", "--optimizer", "keep",
             "--mixed-precision", "bf16"))
    replicated = launch(*args, processes=4, nodes=2)
    split = launch(*args, processes=4, nodes=2, layout="split")
    assert split.samples == replicated.samples
    assert split.losses == replicated.losses
    assert set(split.weights) == {replicated.weights[0]}
    if optimizer == "hybrid8bit":
        assert split.pss_state < replicated.pss_state, (split.pss_state,
                                                        replicated.pss_state)
    _assert_network_as_modelled(split, "split",
                                copy_bytes_per_param=2 if optimizer == "hybrid8bit" else 4)


#: The split layout's checkpoint runs: 2 simulated nodes x 2 ranks, an asynchronous save.
SPLIT_CKPT_ARGS = ("--lazytrain", "--plan", "offload_all", "--batch-size", "2", "--steps", "4")
SPLIT_ENV = {"LAZYTRAIN_NODE_LAYOUT": "split"}


@dataclass
class SplitRun:
    """A split launch saving at step 2 of 4: its losses, each rank's final digests, the
    checkpoint and rank 0's masters at the save."""

    losses: list[float]
    digests: list[dict[str, str]]
    ckpt: Path
    masters: Path


def split_full_run(work: Path) -> SplitRun:
    """The split launch never killed, saving at step 2 of 4, in `work`."""
    losses = _launch_nodes(work, "full", *SPLIT_CKPT_ARGS, "--save-at", "2", "--ckpt-dir",
                           str(work / "ckpt"), "--masters-out", str(work / "m.pt"),
                           "--digest-out", str(work / "full_"), env=SPLIT_ENV)
    return SplitRun(losses=losses, digests=_digests(work / "full_"), ckpt=work / "ckpt",
                    masters=work / "m.pt")


@pytest.fixture(scope="module")
def split_full(tmp_path_factory: pytest.TempPathFactory) -> SplitRun:
    return split_full_run(tmp_path_factory.mktemp("split_full"))


def _digests(prefix: Path) -> list[dict[str, str]]:
    return [json.loads(Path(f"{prefix}{rank}.json").read_text()) for rank in range(4)]


def _assert_resumes_as(full: SplitRun, ckpt: Path, tmp_path: Path) -> None:
    """A fresh split launch from `ckpt` (the save at step 2) ends as `full` did, bit for
    bit: its losses of steps 3-4, every rank's weights and state."""
    resumed = _launch_nodes(tmp_path, "resumed", *SPLIT_CKPT_ARGS, "--resume-from", str(ckpt),
                            "--digest-out", str(tmp_path / "resumed_"), env=SPLIT_ENV)
    assert resumed == full.losses[2:]
    assert _digests(tmp_path / "resumed_") == full.digests


def test_a_split_layout_checkpoint_resumes_bit_exact_and_on_one_process(
        tmp_path: Path, split_full: SplitRun) -> None:
    """A checkpoint of the split layout (2 simulated nodes x 2 ranks, asynchronous): each
    group's share written once, by the rank of the node that updates it (the only one
    holding its moments). A fresh split launch resumes it bit for bit (losses, every
    rank's weights and state); one process re-shards it onto itself: right after
    `load_state` it holds the masters at the save and every parameter's state."""
    manifest = json.loads((split_full.ckpt / "lazytrain_shares.json").read_text())
    assert (manifest["world_size"], manifest["nodes"]) == (4, 2)
    named = [n for s in manifest["shares"] for n in s["params"]]
    assert len(named) == len(set(named))  # each parameter's state once
    assert len([s for s in manifest["shares"] if s["params"]]) == 4  # by each rank
    _assert_resumes_as(split_full, split_full.ckpt, tmp_path)

    # (its per-rank batch stays 2: the plan check refuses a checkpoint planned for another)
    _launch(tmp_path, "one", "--lazytrain", "--plan", "offload_all", "--batch-size", "2",
            "--steps", "2", "--resume-from", str(split_full.ckpt),
            "--digest-out", str(tmp_path / "one_"))
    one = json.loads((tmp_path / "one_0.json").read_text())
    masters = torch.load(split_full.masters)
    weights = hashlib.sha256()
    for name, t in masters.items():
        weights.update(name.encode() + t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert one["weights"] == weights.hexdigest()
    assert int(one["state_params"]) == len(named)


def test_a_node_killed_while_sending_its_weights_stops_the_other_and_resumes_exactly(
        tmp_path: Path, split_full: SplitRun) -> None:
    """The split layout over 2 simulated nodes x 2 ranks, saving at step 2; kill -9 of
    rank 2 (node 1's first) once its update of step 3 has started sending a group's new
    weights to node 0, which is receiving them. Node 0's ranks stop within 60 s of the
    kill naming rank 2 and node 1, nothing is left in /dev/shm, and a fresh launch from
    the step-2 checkpoint ends bit for bit as the run that was never killed."""
    _assert_killing_rank_2_stops_both_nodes(
        tmp_path, *SPLIT_CKPT_ARGS, "--save-at", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
        "--kill-step", "3", "--kill-when", "exchange")
    _assert_resumes_as(split_full, tmp_path / "ckpt", tmp_path)


@dataclass
class KilledLaunch:
    """What a split launch whose rank 2 (node 1's first) killed itself showed."""

    stopped: bool  # every rank exited non-zero
    stop_s: float  # from the kill to the last node's exit
    named: bool  # node 0's two ranks each raised an error naming rank 2 of node 1
    shm_clean: bool  # /dev/shm as before the launch
    node_0_output: str


def kill_rank_2(work: Path, *script_args: str) -> KilledLaunch:
    """A split launch over 2 simulated nodes x 2 ranks in `work` whose rank 2 kills itself
    as `script_args` say (`--kill-step`, `--kill-when`)."""
    segments = _segments()
    losses = work / "killed.json"
    procs = _start_nodes(work, losses, *script_args, "--kill-rank", "2", env=SPLIT_ENV)
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    ended = time.time()
    killed_at = float(Path(f"{losses}.killed_at").read_text())
    return KilledLaunch(
        stopped=all(p.returncode != 0 for p in procs), stop_s=ended - killed_at,
        named=all(re.search(rf"\[rank{rank}\]: [\w.]*Error: .*rank 2 \(node 1, local rank 0",
                            outputs[0]) for rank in (0, 1)),
        shm_clean=_segments() == segments, node_0_output=outputs[0])


def _assert_killing_rank_2_stops_both_nodes(tmp_path: Path, *script_args: str) -> None:
    """`kill_rank_2`: every rank stops, node 0's within 60 s of the kill, its two ranks
    each raising an error naming rank 2 of node 1, and /dev/shm is as before."""
    killed = kill_rank_2(tmp_path, *script_args)
    tail = killed.node_0_output[-6000:]
    assert killed.stopped, tail
    assert killed.stop_s < 60, (killed.stop_s, tail)
    assert killed.named, tail
    assert killed.shm_clean


def test_a_node_killed_mid_step_stops_the_other_naming_it(tmp_path: Path) -> None:
    """The split layout over 2 simulated nodes x 2 ranks, kill -9 of rank 2 (node 1's
    first) between its backward and its update at step 2; node 1's launcher stops its
    other rank. Node 0's ranks stop within 60 s of the kill, their report names rank 2
    and node 1, and no segment is left in /dev/shm."""
    _assert_killing_rank_2_stops_both_nodes(tmp_path, "--steps", "6", "--lazytrain", "--plan",
                                            "checkpoint_all", "--batch-size", "2",
                                            "--kill-step", "2")


def _read_only_store_dir(directory: Path) -> Callable[[int, list[str]], list[str]]:
    """A `wrap` for `_start_nodes`: node 1 runs in a mount namespace of its own where
    `directory` is a read-only bind mount and its node store is to live there."""
    directory.mkdir()
    def wrap(node: int, cmd: list[str]) -> list[str]:
        if node != 1:
            return cmd
        return ["unshare", "--mount", "sh", "-c",
                f'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && '
                f'LAZYTRAIN_NODE_STORE_DIR="{directory}" exec "$@"', "sh", str(directory), *cmd]
    return wrap


def _no_mount_namespace() -> str | None:
    """Why this host cannot give a process a read-only bind mount of its own, or None."""
    try:
        subprocess.run(["unshare", "--mount", "sh", "-c", "mount --bind / /mnt"],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unshare --mount with a bind mount is not permitted here ({err})"
    return None


def test_a_node_that_cannot_open_its_store_stops_every_node_naming_it(tmp_path: Path) -> None:
    """2 simulated nodes x 2 ranks, node 1's node store to be created in a directory that
    is read-only (a mount namespace of its own): node 1's leader cannot create it, and
    every rank of both nodes stops at `prepare` within 60 s, node 0's report naming rank
    2 (node 1, local rank 0) and the error; nothing is left in /dev/shm."""
    if why := _no_mount_namespace():
        pytest.skip(why)
    segments = _segments()
    started = time.time()
    procs = _start_nodes(tmp_path, tmp_path / "losses.json", "--steps", "2", "--lazytrain",
                         "--plan", "checkpoint_all", "--batch-size", "2",
                         wrap=_read_only_store_dir(tmp_path / "store"))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), [out[-3000:] for out in outputs]
    assert time.time() - started < 60 + 30, outputs[0][-4000:]  # 30 s: the launches' start
    for out in outputs:
        assert re.search(r"rank 2 \(node 1, local rank 0, host [^,]+, pid \d+\) could not "
                         r"open the node store: OSError: \[Errno 30\] Read-only file system",
                         out), out[-6000:]
    assert _segments() == segments
