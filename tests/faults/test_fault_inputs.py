"""Wrong inputs fail in `prepare` (or the plugin), before training, each with its own error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fault_helpers import loader, plan_json, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.engine.model.discovery import UnsupportedModelError
from lazytrain_accel.planning import PlanError
from lazytrain_accel.planning.plan import Home


def _prepare(tmp_path: Path, model: torch.nn.Module, **kwargs: object) -> None:
    plugin = LazyTrainPlugin(hardware="h800", cache_dir=str(tmp_path / "cache"),
                             nvme_dir=str(tmp_path / "nvme"), **kwargs)
    Accelerator(cpu=True, plugin=plugin).prepare(
        model, torch.optim.AdamW(model.parameters()), loader())


def test_unknown_hardware_preset(tmp_path) -> None:
    with pytest.raises(ValueError, match="hardware='a100x' is not valid: did you mean "
                                         "'a100-80g'\\? use 'auto', one of"):
        LazyTrainPlugin(hardware="a100x")


@pytest.mark.parametrize(("variable", "value", "words"), [
    ("LAZYTRAIN_MAX_RECOMPUTE_BLOCK", "eight", "must be an integer"),
    ("LAZYTRAIN_OPTIMIZER", "sgd", "allowed values are"),
    ("LAZYTRAIN_PLAN", "fastest", "is not valid"),
    ("LAZYTRAIN_SOLVER_TIME_LIMIT_S", "nan", "must be a finite number"),
])
def test_invalid_environment_values_name_the_variable(monkeypatch, variable, value,
                                                      words) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=words) as info:
        LazyTrainPlugin()
    assert f"environment variable {variable}" in str(info.value)


def test_plan_of_another_run_is_refused(tmp_path) -> None:
    model = tiny_model()
    other = plan_json(tmp_path, model, Home.GPU, hardware="rtx3090")  # another machine
    with pytest.raises(PlanError, match="this plan was made for another run"):
        _prepare(tmp_path, model, plan=other)
    assert all("forward" not in vars(layer) for layer in model.model.layers)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "field"])
def test_damaged_plan_json_is_refused(tmp_path, damage) -> None:
    model = tiny_model()
    path = Path(plan_json(tmp_path, model, Home.CPU))
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff" * 64)
    else:
        data = json.loads(text)
        del data["homes"]
        path.write_text(json.dumps(data))
    words = "incomplete or malformed" if damage == "field" else "not valid JSON"
    with pytest.raises(PlanError, match=words):
        _prepare(tmp_path, model, plan=str(path))


def test_model_without_a_decoder_stack_is_refused(tmp_path) -> None:
    model = tiny_model()
    model.model.layers = torch.nn.ModuleList()  # a model with no decoder layers
    model.config.num_hidden_layers = 0
    with pytest.raises((UnsupportedModelError, ValueError), match="layer"):
        _prepare(tmp_path, model, plan="checkpoint_all")
