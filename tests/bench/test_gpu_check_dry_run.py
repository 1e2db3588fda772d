"""bench/gpu_check.sh --dry-run: the GPU check's code path, on the CPU with tiny models,
so the script is known to work before it meets a GPU: the equivalence suite (a subset),
the QLoRA phase (nf4 and int8 bases loaded with BitsAndBytesConfig, and a bf16 base the
plugin quantizes at prepare, on the emulated async device: the packed pool's staging
path), then training through the Accelerate plugin with measured vs predicted figures."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, measured_hardware: Path,
              keep_measured_hardware: Callable[[Path], None]) -> Iterator[Path]:
    """One hardware profile for both dry runs and the tests after them
    (`measured_hardware`, tests/conftest.py): measuring it took a third of a run."""
    cache = tmp_path_factory.mktemp("cache")
    for profile in measured_hardware.glob("hardware-*.json"):
        shutil.copy(profile, cache)
    yield cache
    keep_measured_hardware(cache)


def dry_run(out: Path, cache_dir: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep
           + os.environ.get("PATH", ""), "LAZYTRAIN_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": pythonpath}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def test_gpu_check_dry_run_writes_its_report(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "out"
    dry_run(out, cache_dir)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    equivalence = report["equivalence"]
    assert {(e["arch"], e["kind"]) for e in equivalence} == {
        (a, "mixed") for a in ("llama", "gpt2")}
    assert all(e["passed"] for e in equivalence), equivalence
    assert {"h2d_bytes_per_s", "d2h_bytes_per_s", "matmul_flops_per_s"} <= set(report["links"])
    assert report["pinning"]["pinned"] is None  # nothing to page-lock on a CPU
    assert report["pinning"]["h2d_pageable_bytes_per_s"] > 0
    paper = report["paper_27b"]  # the paper's workload at this host's measured update rate
    assert paper["host_update_params_per_s"] == report["hardware"]["cpu_optimizer_params_per_s"]
    assert paper["ratio"] == paper["lazytrain_tflops"] / paper["megatrain_tflops"] > 1.0
    assert paper["resident_update"] in ("host", "device")
    device = report["device_update"]  # a CPU's "GPU" update is its host kernel
    assert device["measured_params_per_s"] == report["hardware"]["gpu_optimizer_params_per_s"]
    assert device["preset"] is None and device["measured_over_preset"] is None
    _check_qlora(report["qlora"])
    assert set(report["phase_s"]) == {"equivalence", "links", "qlora", "training"}
    assert report["skipped"] == []  # the dry run is far inside the time budget
    runs = report["runs"]
    # Every strategy either ran at both caps or was refused by the planner, loudly.
    seen = {(r["strategy"], round(r["cap_gib"], 9)) for r in runs}
    seen |= {(r["strategy"], round(r["cap_gib"], 9)) for r in report["refused"]}
    assert {s for s, _ in seen} == {"lazytrain", "megatrain", "checkpoint_all"}
    assert len(seen) == 6
    for r in runs:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_device_bytes"] > 0
        # Each measured part lies inside one step (stats reset between steps, not summed
        # over the run), and each predicted part inside the predicted step.
        assert 0 <= r["measured_stall_s"] < r["step_s"], r
        assert 0 <= r["measured_optimizer_exposed_s"] < r["step_s"], r
        assert r["optimizer_update_s"] > 0, r  # the host update ran, on its thread
        assert 0 <= r["predicted_exposed_s"] < r["predicted_step_s"], r
        assert 0 <= r["predicted_optimizer_exposed_s"] < r["predicted_step_s"], r
        # The training thread updates the residents only when the plan puts them there.
        assert r["resident_update"] in ("host", "device"), r
        assert (r["device_update_s"] > 0) == (r["resident_update"] == "device"), r
    assert set(report["admitted_batch_at_smallest_cap"]) == {"lazytrain", "megatrain",
                                                              "checkpoint_all"}
    table = (out / "gpu_check.txt").read_text()
    assert "lazytrain" in table and "TFLOPS" in table and "opt exp s" in table
    assert "max rel loss diff" in table
    assert "dequant nf4" in table and "\nnf4 " in table and "\nint8 " in table
    assert "\nprepare:nf4 " in table


def test_without_peft_the_qlora_formats_are_skipped_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment with only the package's dependencies has no peft (a test-only
    dependency): the check's modules still import, the QLoRA phase passes, says why in one
    line of its table, and its JSON records the skip (the phase in process: the dry run
    above runs every other phase, which nothing of peft's reaches)."""
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    for name in ("gpu_check", "gpu_qlora", "gpu_equivalence", "gpu_pinning"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    gpu_check = importlib.import_module("gpu_check")  # no module imports peft at the top
    gpu_qlora = gpu_check.gpu_qlora
    hardware = HARDWARE_PRESETS["h800"]
    qlora = gpu_qlora.run_phase(gpu_qlora.dry_setting(), hardware)
    skipped = qlora["skipped"]
    assert skipped.startswith("QLoRA formats skipped: peft"), skipped
    assert "pip install peft" in skipped and ".whl/" in skipped
    assert qlora["results"] == qlora["errors"] == [] and gpu_qlora.passed(qlora)
    assert [m["side"] for m in qlora["dequant"]["measured"]] == [256, 512]  # still measured
    table = gpu_qlora.format_table(qlora)
    assert [line for line in table.splitlines() if "peft" in line] == [skipped]


def _check_qlora(qlora: dict) -> None:
    assert qlora["errors"] == [] and qlora["skipped"] is None
    assert [r["fmt"] for r in qlora["results"]] == ["nf4", "int8", "prepare:nf4"]
    for r in qlora["results"]:
        assert r["passed"] and r["packed_as_stock"] and r["prepared_identical"], r
        assert r["max_rel_loss_diff"] <= 2e-2 and len(r["losses"]) == len(r["stock_losses"])
        assert r["packed_tensors"] == 3 * 7 and r["packed_bytes"] > 0  # 3 layers x 7 linears
        # the CUDA code path of the packed pool ran: staging, side stream, events
        assert r["pool"] == "PackedWeightPool" and r["streams"] == "EmulatedStreams"
        assert r["predicted_step_s"] > 0 and r["step_s"] > 0, r
    assert qlora["device_bytes_left"] == 0  # CPU: nothing to account
    dequant = qlora["dequant"]
    assert dequant["preset"] == "h200" and dequant["preset_bytes_per_s"] > 0
    assert [m["side"] for m in dequant["measured"]] == [256, 512]
    assert all(m["bytes_per_s"] > 0 for m in dequant["measured"])


def test_no_training_run_starts_past_the_time_budget(tmp_path: Path) -> None:
    """A run that would end after `BUDGET_S` is skipped and listed, not started (the
    timeout in gpu_check.sh would kill it and the summary with it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    setting = gpu_check.dry_setting()
    setting.caps_gib = (1.0,)
    report: dict = {"runs": [], "refused": [], "skipped": []}
    hardware = gpu_check.load_hardware("h800")
    late = time.perf_counter() - gpu_check.BUDGET_S - 1.0
    assert gpu_check._train_runs(setting, hardware, report, tmp_path, late) == []
    assert report["runs"] == report["refused"] == []
    assert {r["strategy"] for r in report["skipped"]} == set(gpu_check.STRATEGIES)


def test_a_qlora_format_that_fails_is_reported_and_fails_the_phase() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_qlora

    from lazytrain_accel.profiling.hardware_spec import load_hardware

    report = gpu_qlora.run_phase(gpu_qlora.dry_setting(), load_hardware("h800"),
                                 formats=("nf5",))
    assert report["results"] == [] and [e["fmt"] for e in report["errors"]] == ["nf5"]
    assert not gpu_qlora.passed(report)
    assert "nf5" in gpu_qlora.format_table(report)
