"""`lazytrain_accel.launch` on a script written only against stock transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "trainer_scripts" / "stock_trainer.py"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes",
              "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
LAUNCH = ["-m", "lazytrain_accel.launch"]
STEPS = 6


def _script_args(tmp_path: Path, name: str) -> list[str]:
    return ["--summary", str(tmp_path / f"{name}.json"), "--output_dir", str(tmp_path / name),
            "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
            "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--use_cpu", "--seed", "0"]


def _run(tmp_path: Path, name: str, prefix: list[str], *extra: str
         ) -> tuple[dict, subprocess.CompletedProcess]:
    env = {**os.environ, "LAZYTRAIN_CACHE_DIR": str(tmp_path / "cache"),
           "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_NVME_DIR": str(tmp_path / "nvme")}
    proc = subprocess.run([*prefix, str(SCRIPT), *extra, *_script_args(tmp_path, name)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp_path / f"{name}.json").read_text()), proc


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("stock")
    return _run(tmp_path, "stock", [sys.executable])[0]


def test_without_flag_the_script_runs_as_stock(tmp_path: Path, stock: dict) -> None:
    ours, proc = _run(tmp_path, "plain", [sys.executable, *LAUNCH])
    assert ours == stock  # same losses bit for bit, same optimizer, no lazytrain logs
    assert "LazyTrain plan" not in proc.stderr


def test_lazytrain_keeping_the_optimizer_matches_stock(tmp_path: Path, stock: dict) -> None:
    ours, proc = _run(tmp_path, "keep", [sys.executable, *LAUNCH], "--lazytrain",
                      "--lazytrain_config", '{"plan": "megatrain", "optimizer": "keep"}',
                      "--log_level", "info")  # the plan summary is an INFO line
    assert "LazyTrain plan 'megatrain'" in proc.stderr
    assert ours["optimizer"] == "AdamW"
    assert "lazytrain/stall_s" in ours["log_keys"]
    assert ours["losses"] == pytest.approx(stock["losses"], rel=1e-5, abs=1e-6)


def test_accelerate_launch_module_trains_through_the_engine(tmp_path: Path, stock: dict) -> None:
    config = tmp_path / "lazytrain.yaml"
    config.write_text("plan: checkpoint_all\nmax_recompute_block: 4\n")
    ours, proc = _run(tmp_path, "accel", [*ACCELERATE, *LAUNCH], "--lazytrain",
                      "--lazytrain_config", str(config), "--log_level", "info")
    assert "LazyTrain plan 'checkpoint_all'" in proc.stderr
    assert ours["optimizer"] == "HybridAdamW8bit"  # the default: the script chose no --optim
    assert "lazytrain/plan_gpu_boundaries" in ours["log_keys"]
    assert ours["losses"][0] == pytest.approx(stock["losses"][0], rel=1e-5)
    assert ours["losses"][-1] < ours["losses"][0]
    assert ours["losses"][-1] == pytest.approx(stock["losses"][-1], rel=0.1)


def test_bad_config_is_refused_before_the_script_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, *LAUNCH, str(SCRIPT), "--lazytrain",
                           "--lazytrain_config", '{"plann": "auto"}', "--summary", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unknown field(s) ['plann']" in proc.stderr
