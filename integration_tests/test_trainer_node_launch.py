"""A stock Trainer script under `accelerate launch --multi_gpu --num_processes 2 -m
lazytrain_accel.launch ... --lazytrain` (issue 22, "the same for a Trainer script"): the
Trainer's accelerator prepares through the plugin, so its ranks map one host copy (the
node store) and split the update; losses and weights as one process accumulating the
same global batch, bit for bit; the training state's host bytes as one process's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "trainer_scripts" / "stock_trainer.py"
LAUNCH = ["-m", "lazytrain_accel.launch"]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lazytrain-")}


def _pss_state(ranks: list[dict]) -> int:
    """The training state's host bytes (as test_node_store_launch.py's `_pss_state`): the
    ranks' summed PSS at the end minus each one's runtime (measured before the model is
    built) and its engine's CPU-"device" bytes (host pages standing for GPU memory)."""
    return sum(r["end"] - r["runtime"] - r["device"] for r in ranks)


def _train(tmp_path: Path, name: str, processes: int, config: str, *extra: str,
           micro_batches: int = 1, env: dict[str, str] | None = None
           ) -> tuple[list[float], list[dict]]:
    """One launch of the stock script on the global batch 8 (each rank accumulating
    `micro_batches` of 8 // (processes * micro_batches)); its logged losses (the
    ranks' mean of the accumulated micro-batches' mean) and each rank's `--rank_out`
    record."""
    if processes == 1:
        prefix = [sys.executable, *LAUNCH]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        prefix = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                  "--num_processes", str(processes), "--main_process_port", str(port),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  *LAUNCH]
    args = [str(SCRIPT), "--lazytrain", "--lazytrain_config", config,
            "--summary", str(tmp_path / f"{name}.json"), "--rank_out", str(tmp_path / f"{name}_"),
            "--output_dir", str(tmp_path / name), "--per_device_train_batch_size",
            str(8 // (processes * micro_batches)), "--gradient_accumulation_steps",
            str(micro_batches), "--learning_rate", "3e-3", "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--seed", "0", *extra]
    env = {**os.environ, "LAZYTRAIN_CACHE_DIR": str(tmp_path / "cache"),
           "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_NVME_DIR": str(tmp_path / "nvme"),
           # freed tensors go back to the system in every run (as the plugin's PSS test)
           "MALLOC_MMAP_THRESHOLD_": "131072", **(env or {})}
    proc = subprocess.run([*prefix, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "terminate called" not in proc.stderr
    ranks = [json.loads((tmp_path / f"{name}_{r}.json").read_text()) for r in range(processes)]
    return json.loads((tmp_path / f"{name}.json").read_text())["losses"], ranks


@pytest.mark.parametrize(("optimizer", "plan"), [("hybrid8bit", "offload_all"),
                                                  ("keep", "checkpoint_all")])
def test_two_trainer_processes_share_one_copy_and_train_as_one(tmp_path: Path, optimizer: str,
                                                               plan: str) -> None:
    """2 ranks x batch 4 against one process accumulating 2 micro-batches of 4
    (`--gradient_accumulation_steps 2`): the Trainer logs the mean over the accumulated
    micro-batches, the ranks' mean of theirs, and both sum the same gradients (see
    test_node_store_launch.py): the same losses and weights, bit for bit. The training
    state's host bytes (`_pss_state`), two ranks against one process: at most 1.3x
    (issue 22). Hidden 1024, so that the state (masters, moments, gradients: about 170
    MB) and not each rank's own heap (the Trainer's and the engine's objects, 17-25 MB a
    rank, which one process has once) is what the bar weighs. Measured (3 steps,
    hybrid8bit, 2 loaded cores, two runs): one process 209.4 and 220.8 MB, two ranks
    202.8 and 214.7 MB (0.97x both: the ranks hold the masters and moments once and each
    only its share's gradients, where the accumulating process holds every layer's). At
    hidden 512 the heaps weigh more: 65.2 / 66.8 MB against 90.3 / 82.6 MB (1.38x,
    1.24x)."""
    config = json.dumps({"plan": plan, "optimizer": optimizer})
    extra = ("--max_steps", "3", "--hidden_size", "1024")
    segments = _segments()
    one_losses, (one,) = _train(tmp_path, "one", 1, config, *extra, micro_batches=2)
    two_losses, two = _train(tmp_path, "two", 2, config, *extra)
    assert _segments() == segments  # nothing left under /dev/shm
    # The Trainer's accelerator went through the plugin's prepare: one store, the ranks
    # planned as one node of 2, the same weights on both after the split update.
    assert [r["node_store"] for r in two] == [True, True]
    assert [r["gpus_per_node"] for r in two] == [2, 2]
    assert not one["node_store"]
    assert len(two_losses) == 3
    assert two_losses == one_losses
    assert {r["weights_sha256"] for r in two} == {one["weights_sha256"]}
    state_one, state_two = _pss_state([one]), _pss_state(two)
    assert state_two <= 1.3 * state_one, (state_two, state_one)


def test_a_trainer_checkpoint_under_the_store_resumes_as_the_uninterrupted_run(
        tmp_path: Path) -> None:
    """Issue 22 for the Trainer's own checkpoints: 2 ranks sharing one host copy, hybrid
    8-bit, 4 steps saving at step 2 (the uninterrupted run); a fresh launch resumes from
    checkpoint-2 and trains to step 4: the same losses and final weights, bit for bit.
    The checkpoint, written beside steps 3-4 (checkpoint_mode="async", the default),
    holds every rank's share of the optimizer state, no optimizer.pt (rank 0's share
    only), and the weights in one shard per rank with their index, every weight once."""
    from safetensors import safe_open

    from lazytrain_accel.checkpoints import share_format as sc
    config = json.dumps({"plan": "offload_all", "optimizer": "hybrid8bit"})
    extra = ("--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2")
    # A throttled writer (a few seconds for this model) is still writing while steps 3-4
    # run: their updates wait for it group by group (without that wait the checkpoint
    # would hold some of step 3's weights, and the resume below would differ).
    whole_losses, whole = _train(tmp_path, "whole", 2, config, *extra,
                                 env={"LAZYTRAIN_CHECKPOINT_WRITE_BYTES_PER_S": "500000"})
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {sc.MANIFEST, sc.share_file(0), sc.share_file(1), "model.safetensors.index.json",
            "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "trainer_state.json"} <= files, files
    assert "optimizer.pt" not in files
    manifest = sc.read_manifest(checkpoint)
    assert manifest["world_size"] == 2
    assert all(share["params"] for share in manifest["shares"])  # both shares hold state
    weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text()
                            )["weight_map"]
    assert len(set(weight_map.values())) >= 2  # one shard per rank at least
    keys = []
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(checkpoint / shard), framework="pt") as f:
            keys += list(f.keys())
    assert len(keys) == len(set(keys)) == len(weight_map) == 39  # every tensor, once
    resumed_losses, resumed = _train(tmp_path, "resumed", 2, config, *extra,
                                     "--resume_from_checkpoint", str(checkpoint))
    assert [r["node_store"] for r in resumed] == [True, True]
    assert len(whole_losses) == 4
    assert resumed_losses == whole_losses
    assert {r["weights_sha256"] for r in resumed} == {whole[0]["weights_sha256"]}


def test_replicated_ranks_save_one_whole_checkpoint_and_resume(tmp_path: Path) -> None:
    """2 replicated ranks (LAZYTRAIN_NODE_STORE=off), 4 steps saving at step 2: every
    rank's stock save goes into one temporary directory that rank 0 publishes once all
    have written (before, rank 1 wrote its rng_state_1.pth straight into checkpoint-2
    while rank 0 replaced that folder with its own: a race that lost the file). The
    checkpoint (written beside the next steps) holds both ranks' RNG states and rank 0's
    optimizer share, the whole state; a fresh launch
    resumes from it with the uninterrupted run's losses and weights."""
    config = json.dumps({"plan": "offload_all", "optimizer": "hybrid8bit"})
    extra = ("--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2")
    off = {"LAZYTRAIN_NODE_STORE": "off"}
    whole_losses, whole = _train(tmp_path, "whole", 2, config, *extra, env=off)
    assert [r["node_store"] for r in whole] == [False, False]
    run_dir = tmp_path / "whole"
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # published
    files = {p.name for p in (run_dir / "checkpoint-2").iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer_share_0.safetensors",
            "lazytrain_shares.json", "model.safetensors", "scheduler.pt",
            "trainer_state.json"} <= files, files
    resumed_losses, resumed = _train(tmp_path, "resumed", 2, config, *extra,
                                     "--resume_from_checkpoint",
                                     str(run_dir / "checkpoint-2"), env=off)
    assert len(whole_losses) == 4
    assert resumed_losses == whole_losses
    assert {r["weights_sha256"] for r in resumed} == {whole[0]["weights_sha256"]}


def test_a_split_trainer_at_bf16_saves_every_weight_gathered(tmp_path: Path) -> None:
    """2 simulated nodes x 2 ranks of the stock Trainer script, `--bf16`, the split layout
    (issue 45): each node holds the masters of the layers it updates only, the others as
    their bf16 compute copy, so the weights `trainer.save_model()` writes are gathered on
    every rank first (the Trainer's `_save`): the saved file holds every weight, none a
    placeholder's NaN, each equal to the state dict `accelerator.get_state_dict` gathers
    on every rank (the same digest on all four)."""
    from safetensors.torch import load_file

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "LAZYTRAIN_CACHE_DIR": str(tmp_path / "cache"),
           "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_NVME_DIR": str(tmp_path / "nvme"),
           "LAZYTRAIN_NODE_LAYOUT": "split", "LAZYTRAIN_OVERLAP_STEP": "1"}
    args = [str(SCRIPT), "--lazytrain", "--summary", str(tmp_path / "split.json"),
            "--rank_out", str(tmp_path / "rank_"), "--output_dir", str(tmp_path / "out"),
            "--save_final", str(tmp_path / "final"), "--per_device_train_batch_size", "2",
            "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--use_cpu", "--bf16", "--seed", "0", "--max_steps", "2"]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines",
         "2", "--machine_rank", str(node), "--num_processes", "4", "--main_process_ip",
         "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
         "--dynamo_backend", "no", *LAUNCH, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for node, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{out[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(4)]
    assert len({r["weights_sha256"] for r in ranks}) == 1
    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert saved and not any(t.isnan().any() for t in saved.values())
    # the same values (summed in double, in another order)
    assert sum(float(t.double().sum()) for t in saved.values()) == pytest.approx(
        ranks[0]["weights_sum"], rel=1e-12)
