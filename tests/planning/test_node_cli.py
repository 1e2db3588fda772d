"""`lazytrain plan|simulate|max-batch --gpus-per-node N [--nodes K]` (issue 22)."""

from __future__ import annotations

import json

import pytest

from lazytrain_accel.cli import main

GIB = 2**30
RUN_27B = ["--model", "qwen3.6-27b", "--hardware", "h800", "--batch-size", "8",
           "--seq-len", "1024", "--cpu-memory-gb", "1024"]


def test_27b_on_8_gpus_plans_where_8_copies_would_not_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *RUN_27B, "--gpus-per-node", "8", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["gpus_per_node"], s["nodes"]) == (8, 1)
    assert s["peak_cpu_bytes"] <= 1024 * GIB < 8 * s["one_gpu_peak_cpu_bytes"]
    assert s["node_tokens_per_s"] == pytest.approx(8 * s["tokens_per_s"])
    assert 0.9 * 8 * s["one_gpu_tokens_per_s"] < s["node_tokens_per_s"] <= (
        8 * s["one_gpu_tokens_per_s"])
    assert main(["plan", *RUN_27B, "--gpus-per-node", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per node vs 8 x one GPU alone on the host" in out
    assert "8 copies would need" in out and "job: 2 nodes" in out


def test_simulate_and_max_batch_take_the_node_shape(
        capsys: pytest.CaptureFixture[str]) -> None:
    run = ["--model", "qwen2.5-3b", "--hardware", "h200", "--seq-len", "1024"]
    assert main(["simulate", *run, "--batch-size", "4", "--gpus-per-node", "8", "--json"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert main(["simulate", *run, "--batch-size", "4", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert eight["gpus_per_node"] == 8
    assert eight["step_s"] >= one["step_s"]  # h200's links share the host: never faster
    sizes = []
    for n in ("1", "8"):
        assert main(["max-batch", *run, "--strategy", "offload_all", "--cpu-memory-gb", "64",
                     "--gpus-per-node", n, "--json"]) == 0
        sizes.append(json.loads(capsys.readouterr().out)["max_batch_size"])
    assert sizes[1] < sizes[0]  # 8 ranks' boundaries share one host budget


def test_a_bad_node_shape_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *RUN_27B, "--gpus-per-node", "0"]) == 2
    assert "--gpus-per-node" in capsys.readouterr().err
