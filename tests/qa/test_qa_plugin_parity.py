"""The plugin with optimizer="keep" trains exactly what the stock Accelerator trains:
gradient accumulation, clipping, decay groups, an LR schedule, padding with -100 labels
and dropout, for several families and every plan kind (a CLI-style NVMe plan JSON too)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from qa_helpers import OVERRIDES, build, padded_samples, plugin, train

from lazytrain_accel import Accelerator
from lazytrain_accel.planning import Plan


def nvme_plan_file(tmp_path: Path, arch: str) -> str:
    """The run's offload_all plan with every offloaded boundary homed on NVMe instead."""
    acc = Accelerator(cpu=True, plugin=plugin(tmp_path, "offload_all", optimizer="keep"))
    model = build(arch)
    acc.prepare(model, torch.optim.AdamW(model.parameters()),
                torch.utils.data.DataLoader(padded_samples(), batch_size=2))
    data = acc.lazytrain.run.plan.to_dict()
    acc.end_training()
    data["homes"] = ["nvme" if h == "cpu" else h for h in data["homes"]]
    extra = []
    for t in data["transfers"]:
        if t["kind"] in ("d2h", "h2d"):
            kind = "nvme_write" if t["kind"] == "d2h" else "nvme_read"
            extra.append({**t, "kind": kind})
    data["transfers"] += extra
    data["strategy"] = "qa_all_nvme"
    path = tmp_path / "nvme_plan.json"
    path.write_text(json.dumps(data))
    assert Plan.load(path).count_homes()["nvme"] >= 2
    return str(path)


@pytest.mark.parametrize("kind", ["megatrain", "nvme"])
@pytest.mark.parametrize("arch", sorted(OVERRIDES))
def test_plugin_matches_stock_accelerate(tmp_path: Path, arch: str, kind: str) -> None:
    plan = nvme_plan_file(tmp_path, arch) if kind == "nvme" else kind
    stock = train(build(arch), None)
    ours = train(build(arch), plugin(tmp_path, plan, optimizer="keep"))
    # Bit for bit: the same fp32 ops in the same order (CPU, no mixed precision).
    assert ours.losses == stock.losses
    assert ours.grad_norms == stock.grad_norms
    assert stock.params.keys() == ours.params.keys()
    for name, value in stock.params.items():
        torch.testing.assert_close(ours.params[name], value, rtol=0, atol=0, msg=name)
    assert not list((tmp_path / "nvme").rglob("*.bin")), "boundary files left behind"


@pytest.mark.parametrize("optimizer", ["keep", "hybrid8bit"])
def test_a_scheduler_built_before_prepare_sees_no_overridden_step(tmp_path: Path,
                                                                  optimizer: str) -> None:
    """torch warns "optimizer.step() has been overridden after learning rate scheduler
    initialization" when the step it wrapped was replaced; the plugin's step guard must
    keep that wrapper's mark, as the stock Accelerator never triggers the warning."""
    model = build("llama")
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(user, lambda s: 0.5**s)
    acc = Accelerator(cpu=True, plugin=plugin(tmp_path, "megatrain", optimizer=optimizer))
    loader = torch.utils.data.DataLoader(padded_samples(), batch_size=2)
    model, opt, loader, scheduler = acc.prepare(model, user, loader, scheduler)
    acc.backward(model(**next(iter(loader))).loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(5e-4)]
    acc.end_training()
