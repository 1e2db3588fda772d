"""`lazytrain demo --loss-chunk-tokens`: the demo trains through the fused chunked loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lazytrain_accel.cli import main


def test_demo_trains_with_the_fused_loss(tmp_path: Path, hardware_json: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytrain_accel.engine.core import engine as engine_module
    applied = []

    def recording(model, *, chunk_tokens):
        applied.append(chunk_tokens)
        return apply_fused_loss(model, chunk_tokens=chunk_tokens)

    apply_fused_loss = engine_module.apply_fused_loss
    monkeypatch.setattr(engine_module, "apply_fused_loss", recording)
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code = main(["demo", "--plan", "megatrain", "--steps", "2", "--batch-size", "4",
                 "--eval-count", "4", "--loss-chunk-tokens", "16",
                 "--hardware", str(hardware_json), "--output-dir", str(out)])
    assert code == 0
    summary = json.loads((out / "demo_summary.json").read_text())
    assert applied == [16]
    assert summary["train"]["steps"] == 2 and math.isfinite(summary["train"]["final_loss"])


def test_negative_chunk_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--loss-chunk-tokens", "-1"]) == 2
    assert "argument --loss-chunk-tokens: -1 must be >= 0" in capsys.readouterr().err


def test_auto_reaches_the_plugin_and_beats_the_environment(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    from lazytrain_accel import LazyTrainPlugin
    from lazytrain_accel.demo import run as demo_run

    seen = []

    def fake_run_demo(settings, *_):
        seen.append(settings.loss_chunk_tokens)
        raise ValueError("stop here")  # the CLI turns it into exit code 2

    monkeypatch.setattr(demo_run, "run_demo", fake_run_demo)
    monkeypatch.setenv("LAZYTRAIN_LOSS_CHUNK_TOKENS", "4096")
    main(["demo", "--loss-chunk-tokens", "AUTO"])
    main(["demo", "--loss-chunk-tokens", "64"])
    assert seen == ["auto", 64]
    assert LazyTrainPlugin(loss_chunk_tokens="auto").loss_chunk_tokens == "auto"
