"""`lazytrain profile`: table and JSON output, presets listing, errors as one paragraph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lazytrain_accel.cli import main
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile

_PAPER_ARGS = ["profile", "--model", "qwen3.6-27b", "--hardware", "h800",
               "--batch-size", "72", "--seq-len", "1024"]


def test_paper_27b_table(capsys) -> None:
    assert main(_PAPER_ARGS) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in out.splitlines() if line.count("│") == 3}
    assert rows["layers"] == "64"
    assert rows["boundary bytes (A)"] == "0.703 GiB"
    assert rows["H2D / D2H"] == "12.00 / 12.00 GB/s"


def test_paper_27b_json(capsys) -> None:
    assert main([*_PAPER_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["geometry"]["num_layers"] == 64
    assert out["model"]["boundary_bytes"] / 1024**3 == pytest.approx(0.703, abs=1e-3)
    assert HardwareProfile.from_dict(out["hardware"]) == HARDWARE_PRESETS["h800"]
    seconds = out["seconds"]
    assert seconds["layer_bwd_s"] == pytest.approx(2 * seconds["layer_fwd_s"])
    assert seconds["boundary_d2h_s"] == pytest.approx(out["model"]["boundary_bytes"] / 12e9)


def test_fp32_doubles_the_boundary(capsys) -> None:
    base = ["profile", "--model", "tiny-demo", "--hardware", "rtx3090", "--json"]
    main(base)
    bf16 = json.loads(capsys.readouterr().out)["model"]["boundary_bytes"]
    main([*base, "--dtype", "fp32"])
    assert json.loads(capsys.readouterr().out)["model"]["boundary_bytes"] == 2 * bf16


def test_save_hardware_writes_a_loadable_profile(tmp_path, capsys) -> None:
    path = tmp_path / "hw.json"
    assert main(["profile", "--model", "tiny-demo", "--hardware", "a100-40g", "--json",
                 "--save-hardware", str(path)]) == 0
    assert HardwareProfile.load(path) == HARDWARE_PRESETS["a100-40g"]
    capsys.readouterr()
    assert main(["profile", "--model", "tiny-demo", "--hardware", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["name"] == "a100-40g"


def test_lists(capsys) -> None:
    assert main(["profile", "--list-models", "--list-hardware"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen3.6-27b", "llama3-70b", "tiny-demo", "h800", "rtx4090"):
        assert name in out


@pytest.mark.parametrize(("argv", "message"), [
    (["profile", "--hardware", "h800"], "--model is required"),
    (["profile", "--model", "gpt-9", "--hardware", "h800"], "'gpt-9' is neither a preset"),
    (["profile", "--model", "tiny-demo", "--hardware", "tpu"], "hardware 'tpu' is not valid"),
    (["profile", "--model", "tiny-demo", "--hardware", "h800", "--batch-size", "0"],
     "argument --batch-size: 0 must be >= 1"),
])
def test_errors_are_one_paragraph_with_status_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lazytrain profile: ") and message in err
    assert "Traceback" not in err


def test_console_script_lists_the_subcommand() -> None:
    script = Path(sys.executable).with_name("lazytrain")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "profile" in out.stdout
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                             check=True)
    assert version.stdout.startswith("lazytrain ")


def test_a_qlora_layer_pays_its_dequantization(capsys) -> None:
    base = ["profile", "--model", "llama3-8b", "--hardware", "rtx4090", "--batch-size", "1",
            "--seq-len", "1024", "--lora-rank", "16", "--json"]
    seconds = {}
    for fmt in ("bf16", "nf4"):
        assert main([*base, "--frozen-format", fmt]) == 0
        seconds[fmt] = json.loads(capsys.readouterr().out)["seconds"]
    # the planner's per-layer seconds: the same FLOPs, plus the packed weights' dequant
    hardware = HARDWARE_PRESETS["rtx4090"]
    extra_s = seconds["nf4"]["layer_fwd_s"] - seconds["bf16"]["layer_fwd_s"]
    assert extra_s > 0
    assert seconds["nf4"]["layer_bwd_s"] - seconds["bf16"]["layer_bwd_s"] == pytest.approx(extra_s)
    assert extra_s * hardware.dequant_bytes_per_s > 8 * 4096**2  # > one hidden^2 matrix moved


def test_a_calibrated_profile_shows_the_rates_a_run_measured(tmp_path, capsys) -> None:
    """A run's calibration (kept for `--hardware auto`) gets a row naming what measured it;
    a preset gets none."""
    from lazytrain_accel.profiling.calibration import calibrate

    calibrated = calibrate(HARDWARE_PRESETS["h800"], {"h2d": 5e9}, where="a test run")
    calibrated.save(tmp_path / "calibrated.json")
    assert main([*_PAPER_ARGS[:3], "--hardware", str(tmp_path / "calibrated.json")]) == 0
    out = capsys.readouterr().out
    assert "calibrated by a test run: h2d 5 GB/s" in " ".join(out.split())
    assert "5.00 / 12.00 GB/s" in out  # H2D / D2H
    assert main(_PAPER_ARGS) == 0
    assert "calibrated" not in capsys.readouterr().out
