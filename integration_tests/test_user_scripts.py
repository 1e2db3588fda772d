"""Scripts written as users write them, run as users run them: a run_clm-style script
(`datasets` text files, group_texts, `--gradient_checkpointing`, eval perplexity) and a TRL
SFT script with TRL's default SFTConfig (gradient checkpointing on, dynamic padding), each
stock vs `python -m lazytrain_accel.launch ... --lazytrain` with the optimizer kept (exact)
and with the default hybrid 8-bit one (close). Tiny local model and data; no hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "user_scripts"
sys.path.insert(0, str(SCRIPTS))
import make_assets  # noqa: E402

KEEP = '{"plan": "megatrain", "optimizer": "keep"}'
HYBRID = '{"plan": "offload_all"}'
COMMON = ["--max_steps", "6", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
          "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--seed", "0",
          "--save_strategy", "no"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user_scripts")
    make_assets.make_model_dir(root / "model")
    make_assets.make_text_files(root)
    lines = [json.dumps({"text": s}) for s in make_assets.sentences(64, seed=3)]
    (root / "sft.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _run(root: Path, script: str, out: str, args: list[str], lazytrain: str | None) -> Path:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(root / "ds_cache"),
           "LAZYTRAIN_HARDWARE": "h800", "LAZYTRAIN_CACHE_DIR": str(root / "lt_cache"),
           "LAZYTRAIN_NVME_DIR": str(root / "nvme")}
    launch = ([] if lazytrain is None else
              ["-m", "lazytrain_accel.launch"])
    flags = [] if lazytrain is None else ["--lazytrain", "--lazytrain_config", lazytrain]
    cmd = [sys.executable, *launch, str(SCRIPTS / script), *flags, *args,
           "--output_dir", str(root / out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root / out


def _losses(out: Path) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def _clm_args(root: Path) -> list[str]:
    return ["--model_name_or_path", str(root / "model"), "--train_file", str(root / "train.txt"),
            "--validation_file", str(root / "validation.txt"), "--block_size", "32",
            "--do_train", "--do_eval", "--gradient_checkpointing", *COMMON]


def _sft_args(root: Path) -> list[str]:
    return ["--model_name_or_path", str(root / "model"), "--dataset_file",
            str(root / "sft.jsonl"), "--max_length", "64", "--bf16", "False", *COMMON]


@pytest.fixture(scope="module")
def clm_stock(assets: Path) -> Path:
    return _run(assets, "clm_datasets.py", "clm_stock", _clm_args(assets), None)


@pytest.fixture(scope="module")
def sft_stock(assets: Path) -> Path:
    return _run(assets, "sft_trl.py", "sft_stock", _sft_args(assets), None)


def test_run_clm_style_with_gradient_checkpointing_matches_stock(assets, clm_stock):
    ours = _run(assets, "clm_datasets.py", "clm_keep", _clm_args(assets), KEEP)
    assert len(_losses(clm_stock)) == 6
    assert _losses(ours) == pytest.approx(_losses(clm_stock), rel=1e-5, abs=1e-6)
    stock_eval = json.loads((clm_stock / "metrics.json").read_text())
    eval_ = json.loads((ours / "metrics.json").read_text())
    assert eval_["perplexity"] == pytest.approx(stock_eval["perplexity"], rel=1e-5)


def test_run_clm_style_with_the_default_optimizer_is_close(assets, clm_stock):
    ours = _losses(_run(assets, "clm_datasets.py", "clm_hybrid", _clm_args(assets), HYBRID))
    stock = _losses(clm_stock)
    assert ours[0] == pytest.approx(stock[0], rel=1e-5)  # same init, same first batch
    assert ours[-1] == pytest.approx(stock[-1], rel=0.05)


def test_trl_sft_with_default_sftconfig_matches_stock(assets, sft_stock):
    ours = _run(assets, "sft_trl.py", "sft_keep", [*_sft_args(assets), "--log_level", "info"],
                KEEP)
    assert _losses(ours) == pytest.approx(_losses(sft_stock), rel=1e-5, abs=1e-6)


def test_trl_sft_with_the_default_optimizer_is_close(assets, sft_stock):
    ours = _losses(_run(assets, "sft_trl.py", "sft_hybrid", _sft_args(assets), HYBRID))
    stock = _losses(sft_stock)
    assert ours[0] == pytest.approx(stock[0], rel=1e-5)
    assert ours[-1] == pytest.approx(stock[-1], rel=0.05)
