"""examples/train_clm.py under the HF Trainer, with and without --lazytrain, launched as users
launch it. A tiny Qwen2 (4 layers, hidden 64) on a generated MetaMathQA-form JSONL."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lazytrain_accel.planning.problem import weight_buffer_count

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_clm.py"
SCRIPTS = Path(__file__).parent / "trainer_scripts"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
STEPS = 8
SAVE_STEPS = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 260, "max_position_embeddings": 64, "tie_word_embeddings": False}
    (root / "tiny.json").write_text(json.dumps(config))
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(64):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(json.dumps({"query": f"{a}+{b}?", "response": f"{a}+{b}={a + b}. "
                                f"The answer is: {a + b}"}) + "\n")
    return root


def _env(workdir: Path) -> dict[str, str]:
    return {**os.environ, "LAZYTRAIN_CACHE_DIR": str(workdir / "cache"),
            "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_NVME_DIR": str(workdir / "nvme")}


def _example_args(workdir: Path, out: str, *extra: str) -> list[str]:
    return ["--model", str(workdir / "tiny.json"), "--dataset", str(workdir / "data.jsonl"),
            "--max_seq_len", "32", "--output_dir", str(workdir / out), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
            "--logging_steps", "1", "--save_steps", str(SAVE_STEPS), "--report_to", "none",
            "--use_cpu", "--seed", "0", "--optim", "adamw_torch", *extra]


def _run(cmd: list[str], workdir: Path, expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=_env(workdir), capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _history(workdir: Path, out: str) -> list[dict]:
    return json.loads((workdir / out / "trainer_state.json").read_text())["log_history"]


def _losses(workdir: Path, out: str) -> list[float]:
    return [e["loss"] for e in _history(workdir, out) if "loss" in e]


@pytest.fixture(scope="module")
def stock(workdir: Path) -> list[float]:
    _run([sys.executable, str(EXAMPLE), *_example_args(workdir, "stock")], workdir)
    return _losses(workdir, "stock")


@pytest.fixture(scope="module")
def hybrid(workdir: Path) -> subprocess.CompletedProcess:
    """--lazytrain with the default optimizer; also saves the trained model's logits."""
    return _run([sys.executable, str(SCRIPTS / "run_clm.py"), "--logits-out",
                 str(workdir / "logits.pt"), "--", *_example_args(
                     workdir, "hybrid", "--log_level", "info", "--lazytrain", "--lazytrain_config",
                     '{"plan": "offload_all", "optimizer": "hybrid8bit"}')], workdir)


def test_lazytrain_keeping_adamw_logs_the_same_losses(workdir: Path, stock: list[float]) -> None:
    _run([sys.executable, str(EXAMPLE), *_example_args(
        workdir, "keep", "--lazytrain", "--lazytrain_config",
        '{"plan": "megatrain", "optimizer": "keep"}')], workdir)
    assert len(stock) == STEPS
    assert _losses(workdir, "keep") == pytest.approx(stock, rel=1e-5, abs=1e-6)


def test_hybrid8bit_trains_like_stock_and_logs_the_plan(
        workdir: Path, stock: list[float], hybrid: subprocess.CompletedProcess) -> None:
    ours = _losses(workdir, "hybrid")
    assert ours[0] == pytest.approx(stock[0], rel=1e-5)  # same init, same first batch
    assert ours[-1] < ours[0] * 0.8
    assert ours[-1] == pytest.approx(stock[-1], rel=0.1)
    assert "LazyTrain plan 'offload_all'" in hybrid.stderr
    history = _history(workdir, "hybrid")
    plan = json.loads((workdir / "hybrid" / f"checkpoint-{SAVE_STEPS}" / "lazytrain_plan.json"
                       ).read_text())
    cpu_homes = sum(home == "cpu" for home in plan["homes"])
    assert cpu_homes > 0 and history[0]["lazytrain/plan_cpu_boundaries"] == cpu_homes
    assert history[0]["lazytrain/plan_step_s_predicted"] == plan["prediction"]["step_s"]
    step_logs = [e for e in history if "loss" in e]
    assert [e["step"] for e in step_logs] == list(range(1, STEPS + 1))
    # Bounds from the model (fp32: --use_cpu without --bf16) and the plan: the device
    # holds the streamed layers' weight slots and the boundary being computed, never the
    # whole model; the host holds at least the boundaries the plan homes there.
    model = _tiny_model(workdir)
    layer_bytes = max(_nbytes(layer) for layer in model.model.layers)
    slots = weight_buffer_count(max(e - s for s, e in plan["blocks"]))
    offloaded_bytes = cpu_homes * plan["boundary_bytes"]
    for entry in step_logs:
        assert entry["lazytrain/step_s_measured"] > 0
        assert entry["lazytrain/step_s_predicted"] == plan["prediction"]["step_s"]
        if entry["step"] != SAVE_STEPS + 1:  # the save's wait for the update: outside a step
            assert 0 <= entry["lazytrain/stall_s"] <= entry["lazytrain/step_s_measured"]
        device = entry["lazytrain/peak_device_bytes"]
        assert slots * layer_bytes + plan["boundary_bytes"] <= device < _nbytes(model)
        assert device <= plan["prediction"]["peak_gpu_bytes"]
        host = sum(entry[f"lazytrain/peak_{tier}_bytes"] for tier in ("host_pinned",
                                                                      "host_pageable"))
        assert offloaded_bytes <= host <= plan["prediction"]["peak_cpu_bytes"]
        assert entry["lazytrain/peak_nvme_bytes"] == plan["prediction"]["peak_nvme_bytes"] == 0
    assert all(e["grad_norm"] > 0 for e in step_logs)


def _tiny_model(workdir: Path) -> torch.nn.Module:
    config = json.loads((workdir / "tiny.json").read_text())
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_checkpoint_is_complete_and_loads_without_lazytrain(
        workdir: Path, hybrid: subprocess.CompletedProcess) -> None:
    from safetensors.torch import load_file

    # written beside training (checkpoint_mode="async", the default): the optimizer state
    # in a share file, not optimizer.pt
    checkpoint = workdir / "hybrid" / f"checkpoint-{SAVE_STEPS}"
    for name in ("model.safetensors", "config.json", "optimizer_share_0.safetensors",
                 "lazytrain_shares.json", "scheduler.pt", "rng_state.pth",
                 "lazytrain_plan.json", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
    _run([sys.executable, str(SCRIPTS / "load_without_lazytrain.py"), str(workdir / "hybrid"),
          str(workdir / "logits.pt"), str(workdir / "plain.pt")], workdir)
    plain = torch.load(workdir / "plain.pt")
    assert plain["modules"] == []
    trained = torch.load(workdir / "logits.pt")["logits"]
    torch.testing.assert_close(plain["logits"], trained, rtol=1e-5, atol=1e-5)
    share = load_file(checkpoint / "optimizer_share_0.safetensors")
    codes = [t for t in share.values() if t.dtype in (torch.uint8, torch.int8)]
    assert codes, "the hybrid operator's 8-bit moments are not in the checkpoint"


def test_resume_after_interrupt_continues_exactly(
        workdir: Path, hybrid: subprocess.CompletedProcess) -> None:
    args = _example_args(workdir, "interrupted", "--lazytrain", "--lazytrain_config",
                         '{"plan": "offload_all", "optimizer": "hybrid8bit"}')
    _run([sys.executable, str(SCRIPTS / "run_clm.py"), "--stop-at-save", "--", *args],
         workdir, expect_rc=3)
    checkpoint = workdir / "interrupted" / f"checkpoint-{SAVE_STEPS}"
    assert not (workdir / "interrupted" / "trainer_state.json").exists()  # it did stop
    _run([sys.executable, str(EXAMPLE), *args, "--resume_from_checkpoint", str(checkpoint)],
         workdir)
    assert _losses(workdir, "interrupted") == _losses(workdir, "hybrid")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_as_the_latest(
        workdir: Path) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    args = _example_args(workdir, "killed", "--lazytrain", "--lazytrain_config",
                         '{"plan": "checkpoint_all", "optimizer": "hybrid8bit"}')
    proc = subprocess.run([sys.executable, str(SCRIPTS / "run_clm.py"), "--kill-in-second-save",
                           "--", *args], env=_env(workdir), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -9, proc.stderr[-4000:]  # SIGKILL inside checkpoint-8's save
    out = workdir / "killed"
    assert not (out / f"checkpoint-{2 * SAVE_STEPS}").exists()  # never half-published
    latest = get_last_checkpoint(str(out))
    assert latest == str(out / f"checkpoint-{SAVE_STEPS}")
    assert json.loads((Path(latest) / "trainer_state.json").read_text())["global_step"] == 4
    _run([sys.executable, str(EXAMPLE), *args, "--resume_from_checkpoint", latest], workdir)
    assert not list(out.glob(".lazytrain-staging-*"))  # the dead save's folder is gone
    assert not list(out.glob(".checkpoint-*"))  # and an async save's temporary directory
    assert (out / f"checkpoint-{2 * SAVE_STEPS}" / "trainer_state.json").is_file()


def test_accelerate_launch_runs_the_example(workdir: Path, stock: list[float]) -> None:
    proc = _run([*ACCELERATE, "--cpu", "--num_processes", "1", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLE),
                 *_example_args(workdir, "accel", "--log_level", "info", "--lazytrain",
                                "--lazytrain_config",
                                '{"plan": "checkpoint_all", "optimizer": "keep"}')], workdir)
    assert "LazyTrain plan 'checkpoint_all'" in proc.stderr
    assert _losses(workdir, "accel") == pytest.approx(stock, rel=1e-5, abs=1e-6)
