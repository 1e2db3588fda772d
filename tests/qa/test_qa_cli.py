"""`lazytrain plan --output` for a local model directory, then the plugin runs on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from qa_helpers import build, padded_samples, plugin

from lazytrain_accel import Accelerator
from lazytrain_accel.cli import main
from lazytrain_accel.planning import PlanError


def _plan(tmp_path: Path, *flags: str) -> Path:
    build("llama").save_pretrained(tmp_path / "model")
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tmp_path / "model"), "--hardware", "h800",
                 "--batch-size", "2", "--seq-len", "12", "--strategy", "offload_all",
                 "--output", str(out), *flags]) == 0
    return out


def _prepare(tmp_path: Path, plan_path: Path, mixed_precision: str) -> Accelerator:
    loader = torch.utils.data.DataLoader(padded_samples(), batch_size=2)
    acc = Accelerator(cpu=True, mixed_precision=mixed_precision,
                      plugin=plugin(tmp_path, str(plan_path), optimizer="keep"))
    model = build("llama")
    acc.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    return acc


@pytest.mark.parametrize(("dtype", "mixed_precision"), [("fp32", "no"), ("bf16", "bf16")])
def test_a_cli_plan_fits_the_run_of_its_dtype(tmp_path: Path, dtype: str,
                                              mixed_precision: str) -> None:
    out = _plan(tmp_path, "--dtype", dtype)
    acc = _prepare(tmp_path, out, mixed_precision)
    assert acc.lazytrain.run.plan.strategy == "offload_all"
    acc.end_training()


def test_a_plan_for_another_dtype_is_refused_naming_the_dtype(tmp_path: Path) -> None:
    out = _plan(tmp_path, "--dtype", "bf16")
    with pytest.raises(PlanError, match="dtype"):
        _prepare(tmp_path, out, "no")


def test_simulate_and_max_batch_take_the_dtype(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    build("gpt2").save_pretrained(tmp_path / "model")
    run = ["--model", str(tmp_path / "model"), "--hardware", "rtx3090", "--seq-len", "4",
           "--strategy", "offload_all", "--json", "--resident-update", "host"]
    peaks = {}
    for dtype in ("fp32", "bf16"):
        assert main(["simulate", *run, "--batch-size", "1", "--dtype", dtype]) == 0
        peaks[dtype] = json.loads(capsys.readouterr().out)["peak_gpu_bytes"]
        assert main(["max-batch", *run, "--dtype", dtype]) == 0
        assert json.loads(capsys.readouterr().out)["max_batch_size"] >= 1
    # Weights and boundaries at 4 bytes, not 2; the working set's fp32 parts (the attention
    # kernel's dQ accumulator and logsumexp, and at bf16 the norms' fp32 input copy:
    # profiling/working_set.py) do not double, so fp32 is a little under 2x.
    assert 1.9 * peaks["bf16"] < peaks["fp32"] < 2 * peaks["bf16"]


def test_max_batch_says_when_it_stopped_at_its_search_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build("gpt2").save_pretrained(tmp_path / "model")
    run = ["max-batch", "--model", str(tmp_path / "model"), "--hardware", "h800",
           "--seq-len", "1"]
    assert main([*run, "--json"]) == 0
    unbounded = json.loads(capsys.readouterr().out)
    assert unbounded["search_limit_reached"] is True
    assert main(run) == 0
    assert "search limit" in capsys.readouterr().out
    assert main([*run, "--json", "--gpu-memory-gb", "0.0003"]) == 0
    bounded = json.loads(capsys.readouterr().out)
    assert bounded["search_limit_reached"] is False
    assert 1 <= bounded["max_batch_size"] < unbounded["max_batch_size"]
