"""`accelerator.save_state` / `load_state` of an unmodified script under the node store
(issue 22 items 3 and 5): each weight once (`from_pretrained` loads it), the optimizer
state per share with a manifest, a bit-exact resume on the same world size, a re-shard
onto another. The save is asynchronous (the default `checkpoint_mode`, issue 33): each
rank writes its own groups' weights and share beside the next steps, and the checkpoint
holds what a blocking save at the same step holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from integration_tests.test_accelerate_launch import _launch, _run
from lazytrain_accel.checkpoints import layout, resume
from lazytrain_accel.checkpoints import share_format as sc
from lazytrain_accel.optim import HybridAdamW8bit

ARGS = ("--lazytrain", "--plan", "offload_all", "--steps", "4")  # hybrid 8-bit, overlapped


def test_a_node_store_checkpoint_resumes_bit_exact_and_reshards(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # A throttled writer (about a second for this model) is still writing while the
    # next steps run (the script waits for it only at its end): their updates wait for
    # it group by group.
    full = _launch(tmp_path, "full", *ARGS, "--batch-size", "4", "--save-at", "2",
                   "--ckpt-dir", str(ckpt), "--masters-out", str(tmp_path / "masters.pt"),
                   "--digest-out", str(tmp_path / "full_"), "--finish-save-at-end",
                   num_processes=2, env={"LAZYTRAIN_CHECKPOINT_WRITE_BYTES_PER_S": "500000"})
    manifest = json.loads((ckpt / "lazytrain_shares.json").read_text())
    assert (manifest["world_size"], manifest["local_world_size"], manifest["nodes"]) == (2, 2, 1)
    assert manifest["optimizer_steps"] == 2
    shares = manifest["shares"]
    assert [s["file"] for s in shares] == [f"optimizer_share_{r}.safetensors" for r in (0, 1)]
    named = [n for s in shares for n in s["params"]]
    assert len(named) == len(set(named)) and all(s["params"] for s in shares)  # split, once
    assert not any((ckpt / n).exists() for n in ("optimizer.bin", "model_1.safetensors"))
    # Written asynchronously, each rank its own groups' weights: one shard per rank.
    assert sorted(set(layout.weight_files(ckpt).values())) == [
        ckpt / layout.shard_file(i, 2) for i in (1, 2)]

    # A blocking save at the same step holds the same: manifest, weights, every share.
    blocking = tmp_path / "blocking"
    _launch(tmp_path, "blocking", *ARGS[:-1], "2", "--batch-size", "4", "--save-at", "2",
            "--ckpt-dir", str(blocking), num_processes=2,
            env={"LAZYTRAIN_CHECKPOINT_MODE": "sync"})
    assert sc.read_manifest(blocking) == manifest
    assert list(layout.weight_files(blocking).values()) == [blocking / layout.WEIGHTS] * len(
        layout.weight_files(blocking))  # rank 0 wrote them all, in one file
    assert _weights(blocking).keys() == _weights(ckpt).keys()
    assert all(torch.equal(t, _weights(ckpt)[n]) for n, t in _weights(blocking).items())
    assert _share_digest(blocking, shares) == _share_digest(ckpt, shares)

    # The weights file is the masters at the save, each once, and transformers loads it.
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    masters = torch.load(tmp_path / "masters.pt")
    params = dict(loaded.named_parameters())
    assert params.keys() == masters.keys()
    assert all(torch.equal(params[n], masters[n]) for n in masters)

    # A fresh launch of the same size resumes bit for bit: losses, weights, each share.
    resumed = _launch(tmp_path, "resumed", *ARGS, "--batch-size", "4", "--resume-from",
                      str(ckpt), "--digest-out", str(tmp_path / "resumed_"), num_processes=2)
    assert resumed == full[2:]
    for rank in (0, 1):
        ours = json.loads((tmp_path / f"resumed_{rank}.json").read_text())
        assert ours == json.loads((tmp_path / f"full_{rank}.json").read_text()), rank

    # One process re-shards both shares onto itself: right after `load_state` (no step
    # left to train) it holds the masters and every share's state, byte for byte. (Its
    # per-rank batch stays 4: the plan check refuses a checkpoint planned for another.)
    _launch(tmp_path, "one", *ARGS[:-1], "2", "--batch-size", "4", "--resume-from",
            str(ckpt), "--digest-out", str(tmp_path / "one_"))
    one = json.loads((tmp_path / "one_0.json").read_text())
    assert one["weights"] == _digest([(n, {"": t}) for n, t in masters.items()])
    assert int(one["state_params"]) == len(named)
    assert one["state"] == _share_digest(ckpt, shares)


def _digest(entries: list[tuple[str, dict[str, torch.Tensor]]]) -> str:
    """As the script's `digests`: names (and state keys) in order, then the raw bytes."""
    h = hashlib.sha256()
    for name, items in entries:
        for key in sorted(items):
            raw = items[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            h.update((f"{name}/{key}" if key else name).encode() + raw)
    return h.hexdigest()


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {name: load_file(path)[name] for name, path in layout.weight_files(ckpt).items()}


def _share_digest(ckpt: Path, shares: list[dict]) -> str:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for share in shares:
        for key, tensor in load_file(ckpt / share["file"]).items():
            name, _, item = key.rpartition("/")
            state.setdefault(name, {})[item] = tensor
    return _digest(sorted(state.items()))


def test_the_last_checkpoint_loads_after_a_rank_is_killed(tmp_path: Path) -> None:
    """Save at step 1, kill -9 rank 1 mid-step 2: the launch fails, no temporary
    directory is left beside the checkpoint, and it loads whole (weights and shares)."""
    ckpt = tmp_path / "ckpt"
    proc = _run(tmp_path, "--losses", str(tmp_path / "killed.json"), *ARGS,
                "--batch-size", "4", "--save-at", "1", "--ckpt-dir", str(ckpt),
                "--kill-rank", "1", "--kill-step", "2", num_processes=2)
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == []
    manifest = sc.read_manifest(ckpt)
    assert manifest["optimizer_steps"] == 1
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    optimizer = HybridAdamW8bit(model.parameters(), backend="torch")
    resume.load_optimizer(optimizer, ckpt, manifest, sc.param_names(model), lambda p: True,
                          world_size=1)
    assert len(optimizer.state) == sum(len(s["params"]) for s in manifest["shares"]) > 0


def test_device_residents_on_a_cpu_device_are_saved_before_their_owner_updates_them(
        tmp_path: Path) -> None:
    """`resident_update="device"` on a CPU "device" under the node store: the residents'
    masters are the shared ones, updated on the training thread by their one owner (no
    group is every rank's there), which is also the rank that writes them. A throttled
    async save at step 2 while steps 3-4 run holds what a blocking save holds: the owner's
    device update waited at its gate, and no other rank wrote those bytes."""
    env = {"LAZYTRAIN_RESIDENT_UPDATE": "device"}
    args = ("--lazytrain", "--plan", "auto", "--batch-size", "4", "--save-at", "2")
    ckpt, blocking = tmp_path / "ckpt", tmp_path / "blocking"
    _launch(tmp_path, "async", *args, "--steps", "4", "--ckpt-dir", str(ckpt),
            "--finish-save-at-end", num_processes=2,
            env={**env, "LAZYTRAIN_CHECKPOINT_WRITE_BYTES_PER_S": "500000"})
    assert json.loads((ckpt / "lazytrain_plan.json").read_text())["resident_update"] == "device"
    shares = sc.read_manifest(ckpt)["shares"]
    last = max(g for s in shares for g in s["groups"])  # the output residents
    assert [s["rank"] for s in shares if last in s["groups"]] == [1]  # owned by one rank
    _launch(tmp_path, "blocking", *args, "--steps", "2", "--ckpt-dir", str(blocking),
            num_processes=2, env={**env, "LAZYTRAIN_CHECKPOINT_MODE": "sync"})
    assert _weights(blocking).keys() == _weights(ckpt).keys()
    assert all(torch.equal(t, _weights(ckpt)[n]) for n, t in _weights(blocking).items())
    assert _share_digest(blocking, shares) == _share_digest(ckpt, shares)
