"""`lazytrain demo` end to end with tiny settings: every output file exists and is usable."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lazytrain_accel.cli import main
from lazytrain_accel.data.arithmetic import generate_problems, write_jsonl
from lazytrain_accel.demo.model import DEMO_MODEL_CONFIG
from lazytrain_accel.demo.run import PLAN_SUMMARY_PREFIX
from lazytrain_accel.planning import Home, Plan

STEPS = 3
REPO = Path(__file__).resolve().parents[2]
#: Runs examples/reproduce_exact_match.py with lazytrain_accel made unimportable, and
#: checks AutoTokenizer against the raw tokenizer.json on the held-out prompts.
_PLAIN_TRANSFORMERS = """
import importlib.abc, json, runpy, sys
from pathlib import Path

class NoLazyTrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "lazytrain_accel":
            raise ModuleNotFoundError(f"{name} is blocked: plain transformers only")
        return None

sys.meta_path.insert(0, NoLazyTrain())
script, out = sys.argv[1], Path(sys.argv[2])
result = runpy.run_path(script)["main"](str(out))
from tokenizers import Tokenizer
from transformers import AutoTokenizer
auto = AutoTokenizer.from_pretrained(out / "checkpoint")
raw = Tokenizer.from_file(str(out / "checkpoint" / "tokenizer.json"))
prompts = [q.strip() + "\\n" for q in result["answers"]]
result["same_ids"] = all(auto(p, add_special_tokens=False)["input_ids"]
                         == raw.encode(p, add_special_tokens=False).ids for p in prompts)
result["lazytrain_imported"] = sorted(m for m in sys.modules if m.startswith("lazytrain"))
print(json.dumps(result))
"""


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """stdout and stderr of this process, Python and C level, into `path` (not a TTY)."""
    with path.open("w+") as sink, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        saved = [os.dup(1), os.dup(2)]
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory, hardware_json: Path) -> Path:
    """The output of a tiny demo run; its printed output is in `../printed.txt`."""
    root = tmp_path_factory.mktemp("demo")
    out = root / "out"
    with pytest.MonkeyPatch.context() as env, _output_to(root / "printed.txt"):
        env.setenv("LAZYTRAIN_CACHE_DIR", str(root / "cache"))  # no plan from another run
        env.delenv("KINETO_LOG_LEVEL", raising=False)
        code = main(["demo", "--steps", str(STEPS), "--batch-size", "8", "--eval-count", "8",
                     "--hardware", str(hardware_json), "--nvme-dir", str(root / "nvme"),
                     "--output-dir", str(out)])
    assert code == 0, (root / "printed.txt").read_text()
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


def test_plain_transformers_reproduce_the_exact_match_figure(demo_out: Path) -> None:
    """The documented reload (AutoTokenizer + AutoModelForCausalLM), without
    lazytrain_accel importable, gives the demo's exact match and the same answers."""
    done = subprocess.run([sys.executable, "-c", _PLAIN_TRANSFORMERS,
                           str(REPO / "examples" / "reproduce_exact_match.py"), str(demo_out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    summary = json.loads((demo_out / "demo_summary.json").read_text())
    assert result["lazytrain_imported"] == []
    assert result["same_ids"], "AutoTokenizer encodes the prompts unlike tokenizer.json"
    assert result["exact_match"] == result["reported"] == summary["exact_match_after"]
    assert len(result["answers"]) == summary["eval_problems"]
    for sample in summary["samples_after"]:
        assert result["answers"][sample["query"]] == sample["generated"]


def test_checkpoint_files_are_world_readable(demo_out: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    for path in (demo_out / "checkpoint").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


def test_printed_output_reads_in_a_log(demo_out: Path) -> None:
    """Not a terminal: plain progress lines, the plan once, no profiler or shard noise."""
    printed = (demo_out.parent / "printed.txt").read_text()
    progress = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/3", "3/3"]
    assert all(" tok/s  stall " in line and "(predicted " in line for line in progress)
    assert "USDT" not in printed and "profiler_start" not in printed
    assert "Writing model shards" not in printed
    assert PLAN_SUMMARY_PREFIX not in printed
    assert printed.count("boundaries gpu / cpu / nvme") == 1
    assert "torch threads" in printed  # the count the thread rule chose
    assert "exact match after training" in printed
    assert "[wrong" in printed or "[right" in printed  # labelled sample answers


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
    assert "argument --steps: 0 must be >= 1" in capsys.readouterr().err
    small = tmp_path / "small.jsonl"
    write_jsonl(generate_problems(8, seed=1), small)
    assert main(["demo", "--dataset", str(small), "--batch-size", "64",
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert "--batch-size 64 exceeds" in capsys.readouterr().err


def test_settings_left_out_come_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("LAZYTRAIN_PLAN", "garbage")
    assert main(["demo", "--steps", "1", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "plan='garbage' is not valid" in err
    assert "(value from the environment variable LAZYTRAIN_PLAN)" in err


def test_continues_from_the_saved_checkpoint_with_a_baseline_plan(
        demo_out: Path, tmp_path: Path, hardware_json: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--model reloads the demo's own output (weights and tokenizer); LAZYTRAIN_PLAN picks
    MegaTrain (a flag left out does not override the environment)."""
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LAZYTRAIN_PLAN", "megatrain")
    out = tmp_path / "continued"
    code = main(["demo", "--model", str(demo_out / "checkpoint"),
                 "--steps", "1", "--batch-size", "4", "--eval-count", "4",
                 "--hardware", str(hardware_json), "--output-dir", str(out)])
    assert code == 0
    plan = Plan.load(out / "plan.json")
    assert plan.strategy == "megatrain"
    assert [b for b in plan.blocks if b[1] - b[0] > 1] == [(0, 4), (4, 8)]
    saved = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert saved.get_vocab() == AutoTokenizer.from_pretrained(demo_out / "checkpoint").get_vocab()
