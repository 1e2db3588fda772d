"""optimizer="hybrid8bit" swaps the user's optimizer for AdamW with its hyperparameters:
only meaningful for Adam-family optimizers without options the operator cannot honour."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qa_helpers import build, padded_samples, plugin
from transformers.optimization import Adafactor

from lazytrain_accel import Accelerator
from lazytrain_accel.optim import HybridAdamW8bit


def _prepare(tmp_path: Path, make, optimizer: str = "hybrid8bit"):
    model = build("llama")
    acc = Accelerator(cpu=True, plugin=plugin(tmp_path, "offload_all", optimizer=optimizer))
    loader = torch.utils.data.DataLoader(padded_samples(), batch_size=2)
    try:
        return acc.prepare(model, make(model.parameters()), loader)[1]
    finally:
        acc.end_training()


@pytest.mark.parametrize(("make", "named"), [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "SGD"),
    (lambda p: Adafactor(p, lr=None, relative_step=True, warmup_init=True), "Adafactor"),
    (lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3, maximize=True), "maximize"),
])
def test_what_adamw_cannot_replace_is_refused_with_the_way_out(tmp_path: Path, make,
                                                                 named: str) -> None:
    with pytest.raises(ValueError, match=rf"(?s){named}.*optimizer='keep'"):
        _prepare(tmp_path, make)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: Adafactor(p, lr=None, relative_step=True, warmup_init=True),
])
def test_keep_still_takes_any_optimizer(tmp_path: Path, make) -> None:
    opt = _prepare(tmp_path, make, optimizer="keep")
    assert not isinstance(opt.optimizer, HybridAdamW8bit)


def test_adam_family_is_replaced_with_its_hyperparameters(tmp_path: Path) -> None:
    opt = _prepare(tmp_path, lambda p: torch.optim.AdamW(p, lr=3e-4, betas=(0.8, 0.95),
                                                         eps=1e-6, weight_decay=0.05))
    inner = opt.optimizer
    assert isinstance(inner, HybridAdamW8bit)
    group = inner.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-4, (0.8, 0.95), 1e-6, 0.05)
