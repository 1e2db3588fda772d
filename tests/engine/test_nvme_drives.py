"""Several drives (`nvme_dir` naming one directory per drive, issue 44): decoder layer j's
state files and boundary j's file go to directory j % D, each drive with I/O threads of
its own; the run is the one-drive run bit for bit and leaves nothing on any drive."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from engine_helpers import build_model, make_plan, train_clipped, twin

from lazytrain_accel.engine.memory.nvme import NvmeSpill
from lazytrain_accel.planning.plan import StateHomes

LAYERS = 4


def test_state_and_boundaries_spread_over_two_drives_train_as_on_one(tmp_path, monkeypatch):
    ref = build_model("llama", LAYERS)
    model = twin(ref)
    homes = StateHomes(optimizer=(1, 2, 3, 4), grads=(1, 2), copies=(2, 3, 4))
    plan = dataclasses.replace(make_plan("all_nvme", LAYERS), state=homes)
    ref_engine, ref_opt, ref_losses = train_clipped(ref, plan, tmp_path / "one",
                                                    dtype=torch.bfloat16)
    ref_engine.detach()
    boundaries: dict[str, set[str]] = {}
    write = NvmeSpill._write

    def recorded(spill: NvmeSpill, path: Path, raw: torch.Tensor) -> None:
        boundaries.setdefault(path.parent.parent.name, set()).add(path.name)
        write(spill, path, raw)

    monkeypatch.setattr(NvmeSpill, "_write", recorded)
    state: dict[str, set[str]] = {}

    def between(engine, opt, step: int) -> None:
        for directory in engine.spill.state_dirs:
            state.setdefault(directory.parent.parent.name, set()).update(
                p.name for p in directory.iterdir())

    drives = [tmp_path / "drive0", tmp_path / "drive1"]
    engine, opt, losses = train_clipped(model, plan, ",".join(map(str, drives)),
                                        dtype=torch.bfloat16, after_step=between)
    assert losses == ref_losses
    assert [d.parent for d in engine.spill.directories] == drives
    # layer (and boundary) j on drive j % 2
    assert state["drive0"] == {"optim-2.bin", "optim-4.bin", "grad-2.bin", "copy-2.bin",
                               "copy-4.bin"}
    assert state["drive1"] == {"optim-1.bin", "optim-3.bin", "grad-1.bin", "copy-3.bin"}
    def indices(names: set[str]) -> set[int]:
        return {int(n.rsplit("-b", 1)[1].removesuffix(".bin")) for n in names}

    assert indices(boundaries["drive0"]) == {2}  # the plan's NVMe boundaries: 1, 2, 3
    assert indices(boundaries["drive1"]) == {1, 3}
    directories = engine.spill.directories
    engine.detach()
    assert not any(d.exists() for d in directories)
    assert sorted(p.name for p in tmp_path.glob("drive*/*")) == []
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        for name, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][name]), name
