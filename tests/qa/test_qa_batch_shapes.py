"""The plan is sized for the longest batch the run can produce; a dynamically padded loader
that sends a longer batch later re-plans once upward (cached) before that batch runs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from qa_helpers import VOCAB, build, plugin

from lazytrain_accel import Accelerator


def _pad_to_longest(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows],
                                           batch_first=True)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def _rows(lengths: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


def _run(tmp_path: Path, lengths: list[int], *, with_loader: bool = True,
         **settings: object) -> tuple[list[float], Accelerator]:
    loader = torch.utils.data.DataLoader(_rows(lengths), batch_size=2,
                                         collate_fn=_pad_to_longest)
    model = build("llama")
    acc = Accelerator(cpu=True, plugin=plugin(tmp_path, settings.pop("plan", "offload_all"),
                                              optimizer=settings.pop("optimizer", "keep"),
                                              **settings))
    opt = torch.optim.AdamW(model.parameters())
    if with_loader:
        model, opt, loader = acc.prepare(model, opt, loader)
    else:
        model, opt = acc.prepare(model, opt)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        acc.backward(loss)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, acc


def _stock(lengths: list[int]) -> list[float]:
    model = build("llama")
    opt = torch.optim.AdamW(model.parameters())
    losses = []
    for batch in torch.utils.data.DataLoader(_rows(lengths), batch_size=2,
                                             collate_fn=_pad_to_longest):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def test_a_longer_batch_replans_once_upward_before_it_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lengths = [6, 5, 20, 9, 30, 4]
    with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
        losses, acc = _run(tmp_path, lengths)
    plans = [r.message for r in caplog.records if "LazyTrain plan" in r.message]
    assert len(plans) == 2, plans  # the first batch's 2 x 6, then 2 x 32 (covers 20 and 30)
    assert "batch 2 x seq 6" in plans[0] and "batch 2 x seq 32" in plans[1]
    assert "sized from a longer batch" in plans[1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert acc.lazytrain.engine.plan.seq_len == 32 == acc.lazytrain.run.plan.seq_len
    assert losses == _stock(lengths)
    acc.end_training()


def test_no_loader_plans_for_the_first_batch_and_says_nothing_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
        _, acc = _run(tmp_path, [12, 5, 12, 9], with_loader=False)
    plans = [r.message for r in caplog.records if "LazyTrain plan" in r.message]
    assert len(plans) == 1 and "batch 2 x seq 12" in plans[0], plans  # never seq 64
    acc.end_training()


def test_explicit_shape_fields_size_the_plan(tmp_path: Path) -> None:
    _, acc = _run(tmp_path, [12, 5, 12, 9], batch_size=2, seq_len=16)
    assert (acc.lazytrain.engine.plan.batch_size, acc.lazytrain.engine.plan.seq_len) == (2, 16)
    acc.end_training()


def test_a_plan_file_is_not_replanned_and_the_warning_names_no_gpu_on_cpu(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, acc = _run(tmp_path, [6, 6])
    path = tmp_path / "plan.json"
    acc.lazytrain.run.plan.save(path)
    acc.end_training()
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        _, acc = _run(tmp_path, [6, 5, 20, 9, 30, 4], plan=str(path))
    beyond = [r.message for r in caplog.records if "beyond the plan" in r.message]
    assert len(beyond) == 1 and "2 x 20" in beyond[0] and "2 x 6" in beyond[0]
    assert "GPU" not in beyond[0]
    acc.end_training()


def test_batches_within_the_plan_say_nothing(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        _, acc = _run(tmp_path, [12, 5, 12, 9, 3])  # the last batch holds one row
    assert not [r for r in caplog.records if "beyond the plan" in r.message]
    assert acc.lazytrain.engine.plan.seq_len == 12
    acc.end_training()


def test_resuming_a_checkpoint_planned_for_longer_batches_adopts_its_shape(
        tmp_path: Path) -> None:
    _, acc = _run(tmp_path, [6, 5, 20, 9])
    acc.save_state(str(tmp_path / "ckpt"))
    acc.end_training()
    _, resumed = _run(tmp_path, [6, 5])  # planned 2 x 6 from its first batch
    resumed.load_state(str(tmp_path / "ckpt"))  # the checkpoint's plan is 2 x 32: no error
    assert resumed.lazytrain.engine.plan.seq_len == 32
    resumed.end_training()


def test_resuming_a_longer_shape_reaches_the_replanner_too(tmp_path: Path) -> None:
    """Issue 31: `load_state` of a checkpoint planned for a longer shape re-planned the
    run and the engine, but the re-planner kept solving and pricing with the 2 x 6 model
    profile (the plan lived in three places, kept in step by callbacks)."""
    _, acc = _run(tmp_path, [6, 5, 20, 9])
    acc.save_state(str(tmp_path / "ckpt"))
    acc.end_training()
    _, resumed = _run(tmp_path, [6, 5])
    assert resumed.lazytrain.replanner is not None  # replan="auto" is the default
    resumed.load_state(str(tmp_path / "ckpt"))
    assert resumed.lazytrain.run.model_profile.seq_len == 32
    assert resumed.lazytrain.replanner.run.model_profile.seq_len == 32
    assert resumed.lazytrain.replanner.run is resumed.lazytrain.run  # one plan, one place
    assert resumed.lazytrain.engine.plan is resumed.lazytrain.run.plan
    resumed.end_training()


@pytest.mark.parametrize("resident_update", ["device", "host"])
def test_a_replan_keeps_the_engines_residents_where_they_are(
        tmp_path: Path, resident_update: str) -> None:
    """The re-planned run keeps the first plan's resident_update (the engine cannot move
    masters mid-run) and trains like stock with the hybrid 8-bit update either way."""
    lengths = [6, 5, 20, 9]
    losses, acc = _run(tmp_path, lengths, plan="auto", optimizer="hybrid8bit",
                       resident_update=resident_update)
    assert acc.lazytrain.engine.plan.seq_len == 32
    assert acc.lazytrain.engine.plan.resident_update == resident_update
    assert all(isinstance(loss, float) for loss in losses)
    acc.end_training()


def test_a_replan_request_overrides_the_configs_resident_update(tmp_path: Path) -> None:
    from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
    from lazytrain_accel.run import setup

    config = plugin(tmp_path, "auto", resident_update="device")
    profile = setup.profile_for_run(build("llama"), batch_size=2, seq_len=8,
                                    compute_dtype=None, loss_chunk_tokens=0)
    h800 = HARDWARE_PRESETS["h800"]
    assert setup.resolve_plan(config, profile, h800).resident_update == "device"
    assert setup.resolve_plan(config, profile, h800,
                              resident_update="host").resident_update == "host"
