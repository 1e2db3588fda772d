"""`lazytrain demo` end to end with tiny settings: every output file exists and is usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lazytrain_accel.cli import main
from lazytrain_accel.data.arithmetic import generate_problems, write_jsonl
from lazytrain_accel.demo.model import DEMO_MODEL_CONFIG
from lazytrain_accel.planning import Home, Plan

STEPS = 3


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory, hardware_json: Path) -> Path:
    root = tmp_path_factory.mktemp("demo")
    out = root / "out"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LAZYTRAIN_CACHE_DIR", str(root / "cache"))  # no plan from another run
        code = main(["demo", "--steps", str(STEPS), "--batch-size", "8", "--eval-count", "8",
                     "--hardware", str(hardware_json), "--nvme-dir", str(root / "nvme"),
                     "--output-dir", str(out)])
    assert code == 0
    return out


def test_checkpoint_reloads_as_a_plain_hf_model_with_its_tokenizer(demo_out: Path) -> None:
    checkpoint = demo_out / "checkpoint"
    assert (checkpoint / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.num_hidden_layers == DEMO_MODEL_CONFIG["num_hidden_layers"]
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer("Tom has 3 apples.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_plan_json_is_the_plan_of_this_run(demo_out: Path) -> None:
    plan = Plan.load(demo_out / "plan.json")
    assert plan.num_layers == DEMO_MODEL_CONFIG["num_hidden_layers"]
    assert (plan.batch_size, plan.seq_len) == (8, 48)
    # The demo budget is small on purpose: some boundaries must leave the device.
    assert any(h != Home.GPU for h in plan.homes)


def test_timeline_is_a_png_and_traces_are_chrome_json(demo_out: Path) -> None:
    assert (demo_out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    predicted = json.loads((demo_out / "trace_predicted_step.json").read_text())
    assert {e["cat"] for e in predicted["traceEvents"] if e["ph"] == "X"} >= {"compute", "h2d"}
    measured = json.loads((demo_out / "trace_measured_step.json").read_text())
    names = {e.get("name", "") for e in measured["traceEvents"]}
    assert any("aten::" in name for name in names)  # real ops of a measured step


def test_summary_reports_both_evaluations_and_the_training(demo_out: Path) -> None:
    summary = json.loads((demo_out / "demo_summary.json").read_text())
    assert summary["train"]["steps"] == STEPS
    assert 0.0 <= summary["exact_match_before"] <= 1.0
    assert 0.0 <= summary["exact_match_after"] <= 1.0
    assert summary["eval_problems"] >= 1
    assert summary["train"]["tokens_per_s"] > 0
    for path in summary["files"].values():
        assert Path(path).exists(), path


def test_own_dataset_and_bad_flags_are_reported_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "response": "no final answer"}\n')
    assert main(["demo", "--dataset", str(bad), "--output-dir", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:1: response does not end" in capsys.readouterr().err
    assert main(["demo", "--steps", "0"]) == 2
    assert "steps=0 must be >= 1" in capsys.readouterr().err
    small = tmp_path / "small.jsonl"
    write_jsonl(generate_problems(8, seed=1), small)
    assert main(["demo", "--dataset", str(small), "--batch-size", "64",
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert "--batch-size 64 exceeds" in capsys.readouterr().err


def test_continues_from_the_saved_checkpoint_with_a_baseline_plan(
        demo_out: Path, tmp_path: Path, hardware_json: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--model reloads the demo's own output (weights and tokenizer), --plan picks MegaTrain."""
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "continued"
    code = main(["demo", "--model", str(demo_out / "checkpoint"), "--plan", "megatrain",
                 "--steps", "1", "--batch-size", "4", "--eval-count", "4",
                 "--hardware", str(hardware_json), "--output-dir", str(out)])
    assert code == 0
    plan = Plan.load(out / "plan.json")
    assert plan.strategy == "megatrain"
    assert [b for b in plan.blocks if b[1] - b[0] > 1] == [(0, 4), (4, 8)]
    saved = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert saved.get_vocab() == AutoTokenizer.from_pretrained(demo_out / "checkpoint").get_vocab()
