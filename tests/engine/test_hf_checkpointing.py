"""HF gradient checkpointing requested before or after attach is absorbed, not refused."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from engine_helpers import batches, build_model, make_plan, twin

from lazytrain_accel.engine import attach

CPU = torch.device("cpu")


def _enable(model: torch.nn.Module, how: str) -> None:
    if how == "gradient_checkpointing_enable":
        model.gradient_checkpointing_enable()
    elif how == "with_kwargs":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.activation_checkpointing_enable(every_n_layers=2)


def _train(ref, model, steps: int = 2) -> None:
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step, ids in enumerate(batches(steps)):
        for m, opt in zip((ref, model), opts, strict=True):
            torch.manual_seed(step)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_* are deprecated
@pytest.mark.parametrize("how", ["gradient_checkpointing_enable", "with_kwargs",
                                 "activation_checkpointing_enable"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_checkpointing_requests_are_turned_off_with_stock_parity(how, when, tmp_path, caplog):
    ref = build_model("llama", 4)
    model = twin(ref)
    _enable(ref, how)  # stock runs with HF checkpointing on: same math, other memory
    if when == "before":
        _enable(model, how)
    with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
        attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))
        if when == "after":
            _enable(model, how)
        _enable(model, how)  # a second request says nothing new
        _train(ref, model)
    assert not model.is_activation_checkpointing
    ours = [r for r in caplog.records if r.name == "lazytrain_accel"]
    said = [r.getMessage() for r in ours if "checkpointing" in r.getMessage()]
    assert len(said) == 1 and all(r.levelno == logging.INFO for r in ours)
    assert "3 of 4 layer inputs recomputed" in said[0]
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_copies_and_detached_models_checkpoint_as_hf_does(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("checkpoint_all", 4), device=CPU, nvme_dir=str(tmp_path))
    plain = copy.deepcopy(model)
    plain.gradient_checkpointing_enable()
    assert plain.is_activation_checkpointing  # a copy is a plain model
    engine.detach()
    model.gradient_checkpointing_enable()
    assert model.is_activation_checkpointing  # detached: HF's own behaviour is back


def test_a_flag_set_by_hand_on_a_streamed_layer_is_named(tmp_path):
    model = build_model("qwen2", 4)
    attach(model, make_plan("checkpoint_all", 4), device=CPU, nvme_dir=str(tmp_path))
    model.model.layers[2].gradient_checkpointing = True
    ids = batches(1)[0]
    with pytest.raises(ValueError, match="set by hand on streamed layer 3"):
        model(input_ids=ids, labels=ids)
