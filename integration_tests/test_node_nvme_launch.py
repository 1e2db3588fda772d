"""Ranks sharing a node store, their DRAM budget short of the host state (issues 44 and
45): the plan homes masters and moments on NVMe, each layer's on the drive of the rank
that updates it, the store holding its compute copy for every local rank. Two ranks on
one node, and two simulated nodes of two ranks under the split layout (a layer's
masters on the one node that updates it), train bit for bit as with all in DRAM; a full
state dict gathers the homed masters on every rank; a split checkpoint resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from integration_tests.test_accelerate_launch import _launch
from integration_tests.test_node_store_launch import _launch_nodes
from lazytrain_accel.planning.problem import build_problem
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.run import setup

HIDDEN, LAYERS, BATCH = 128, 16, 4
ARGS = ("--lazytrain", "--plan", "checkpoint_all", "--mixed-precision", "bf16",
        "--hidden-size", str(HIDDEN), "--layers", str(LAYERS), "--batch-size", str(BATCH),
        "--steps", "4")


def _budget_gb(short_layers: float, batch_size: int = BATCH, nodes: int = 1,
               layout: str = "replicated") -> float:
    """The node's DRAM budget short of its host state by `short_layers` layers' masters
    and moments (a node's share of them under the split layout over 2 nodes; the model
    `accelerate_train.py` builds, planned for 2 ranks a node)."""
    config = Qwen2Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    profile = setup.profile_for_run(Qwen2ForCausalLM(config), batch_size=batch_size,
                                    seq_len=16, compute_dtype=torch.bfloat16)
    p = build_problem(profile, HARDWARE_PRESETS["h800"], gpus_per_node=2,
                      nodes=nodes, node_layout=layout)
    return (p.cpu_fixed_bytes - short_layers * p.state_sizes.optimizer_bytes) / 2**30


def _weights(directory: Path, ranks: int) -> list[str]:
    return [json.loads((directory / f"digest_{r}.json").read_text())["weights"]
            for r in range(ranks)]


def _homed_layers(directory: Path) -> list[int]:
    """The layers whose masters the launch's plan (cached by its ranks) homes on NVMe."""
    (plan,) = {p.read_text() for p in (directory / "cache" / "plans").glob("*.json")}
    state = json.loads(plan)["state"]
    assert not state["grads"] and not state["copies"]  # in DRAM, the copies in the store
    return state["optimizer"]


def test_two_ranks_home_masters_on_their_drives_and_train_as_in_dram(tmp_path: Path) -> None:
    out = {}
    for name, budget_gb in (("dram", "0"), ("homed", f"{_budget_gb(0.4 * LAYERS):.9f}")):
        d = tmp_path / name
        env = {"LAZYTRAIN_CPU_MEMORY_LIMIT_GB": budget_gb, "LAZYTRAIN_THREADS": "0"}
        losses = _launch(d, name, *ARGS, "--digest-out", str(d / "digest_"),
                         num_processes=2, env=env)
        out[name] = losses, _weights(d, 2), _homed_layers(d)
        assert not list((d / "nvme").glob("lazytrain-*"))  # removed at the end
    assert len(out["homed"][2]) >= 0.4 * LAYERS and not out["dram"][2]
    assert out["homed"][0] == out["dram"][0]
    # every rank's full state dict (rank 0 gathers the masters rank 1 homes, and back)
    assert out["homed"][1] == out["dram"][1] == [out["dram"][1][0]] * 2


def test_two_split_nodes_home_masters_on_their_drives(tmp_path: Path) -> None:
    """2 simulated nodes x 2 ranks under the split layout: each layer's masters live on
    the one node that updates it, on its owner's drive; the others hold its compute copy,
    and a full state dict reads the masters from the owners' files. Bit for bit the split
    launch with all in DRAM (which is the replicated one's at bf16 over 2 nodes:
    `test_node_store_launch.py`), every rank's gathered weights alike; the checkpoint at
    step 2 resumes the last step exactly (each group saved where it is updated, from the
    owner's files where homed; the node that does not update a layer loads its weights
    into that layer's compute copy, cast as its node casts it). The replicated layout
    homes per node as one node does (the test above: each node's owner of a layer homes
    it on its node's drives), so it has no launch of its own here."""
    args = (*ARGS[:-4], "--batch-size", "2", "--steps", "3")
    ckpt = tmp_path / "ckpt"
    # a split node holds half the state: short by fewer layers' masters
    launches = (("dram", "split", 0.0, ()),
                ("split", "split", 0.15, ("--save-at", "2", "--ckpt-dir", str(ckpt))),
                ("resumed", "split", 0.15, ("--resume-from", str(ckpt))))
    out = {}
    for name, layout, short, extra in launches:
        d = tmp_path / name
        budget = f"{_budget_gb(short * LAYERS, batch_size=2, nodes=2, layout=layout):.9f}" \
            if short else "0"
        env = {"LAZYTRAIN_THREADS": "0", "LAZYTRAIN_NODE_LAYOUT": layout,
               "LAZYTRAIN_CPU_MEMORY_LIMIT_GB": budget}
        losses = _launch_nodes(d, name, *args, *extra, "--digest-out", str(d / "digest_"),
                               env=env)
        out[name] = losses, _weights(d, 4), _homed_layers(d)
        assert not list((d / "nvme").glob("lazytrain-*"))
    assert not out["dram"][2]
    assert len(out["split"][2]) >= 0.6 * LAYERS, out["split"][2]
    assert out["split"][:2] == out["dram"][:2]
    assert len(set(out["dram"][1])) == 1
    assert out["resumed"][0] == out["split"][0][2:]
    assert out["resumed"][1] == out["split"][1]
