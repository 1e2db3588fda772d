"""The plan is sized from the first batch prepare() sees; a dynamically padded loader can
send longer batches later, beyond the planned activation bytes (an OOM on a GPU)."""

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


def _run(tmp_path: Path, lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=_pad_to_longest)
    model = build("llama")
    acc = Accelerator(cpu=True, plugin=plugin(tmp_path, "offload_all", optimizer="keep"))
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    for batch in loader:
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
    acc.end_training()


def test_a_batch_beyond_the_planned_shape_is_reported_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        _run(tmp_path, [6, 5, 20, 9, 30, 4])
    beyond = [r.message for r in caplog.records if "beyond the plan" in r.message]
    assert len(beyond) == 1, beyond
    assert "2 x 20" in beyond[0] and "2 x 6" in beyond[0]


def test_batches_within_the_plan_say_nothing(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        _run(tmp_path, [12, 5, 12, 9, 3])  # the last batch holds one row
    assert not [r for r in caplog.records if "beyond the plan" in r.message]
