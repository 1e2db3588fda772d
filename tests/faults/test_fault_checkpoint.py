"""Atomic checkpoints: what a killed save leaves behind is undone; resume is bit-identical
on CPU (data order, RNG, 8-bit optimizer state, plan)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from fault_helpers import BATCH, SEQ, VOCAB, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.checkpoints import atomic
from lazytrain_accel.checkpoints.atomic import (
    atomic_directory,
    recover,
    recover_all,
    remove_directory,
)
from lazytrain_accel.frontends import share_checkpoint
from lazytrain_accel.frontends.accelerate import PLAN_FILE
from lazytrain_accel.optim import HybridAdamW8bit


def test_an_error_mid_save_keeps_the_previous_directory(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(RuntimeError, match="disk"), atomic_directory(final) as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("disk went away")
    assert (final / "a").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp left
    with atomic_directory(final) as tmp:
        (tmp / "b").write_text("second")
    assert sorted(p.name for p in final.iterdir()) == ["b"]  # replaced whole


def test_recover_puts_back_a_checkpoint_moved_aside_by_a_killed_save(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "a").write_text("first")
    dead = 2**22 + 12345  # above pid_max's default: no such process
    final.rename(tmp_path / f".ckpt.old-{dead}")  # the kill came between the renames
    (tmp_path / f".ckpt.tmp-{dead}").mkdir()
    recover(final)
    assert (final / "a").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_live_saver_keeps_its_temp(tmp_path: Path) -> None:
    parent = os.getppid()
    (tmp_path / f".ckpt.tmp-{parent}").mkdir()
    recover(tmp_path / "ckpt")
    assert (tmp_path / f".ckpt.tmp-{parent}").is_dir()


def test_a_killed_saver_not_yet_reaped_is_dead(tmp_path: Path) -> None:
    """A zombie (killed, its parent not waiting for it: a container's PID 1 may never)
    answers kill(pid, 0): its temporary directory goes all the same."""
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "`true` did not exit within 60 s"
        time.sleep(0.01)
    (tmp_path / f".ckpt.tmp-{zombie.pid}").mkdir()
    recover(tmp_path / "ckpt")
    zombie.wait()
    assert list(tmp_path.iterdir()) == []


def test_a_rotation_killed_midway_leaves_no_half_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oldest checkpoint leaves its name before its files go; a later `recover_all`
    ends the removal."""
    folder = tmp_path / "checkpoint_0"
    folder.mkdir()
    (folder / "weights").write_text("w")

    def killed(path: Path, *args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the kill, before any file is removed

    monkeypatch.setattr(atomic.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        remove_directory(folder)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [f".checkpoint_0.gone-{os.getpid()}"]
    dead = 2**22 + 12345  # the next run: the remover is gone
    (tmp_path / f".checkpoint_0.gone-{os.getpid()}").rename(
        tmp_path / f".checkpoint_0.gone-{dead}")
    recover_all(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_latest_checkpoint_is_never_what_a_killed_save_left(tmp_path: Path) -> None:
    """`load_state()` under automatic naming: `recover_all` undoes every killed save of
    the folder (and ends a killed rotation's removal) and the latest is the highest
    published `checkpoint_<i>`, where stock accelerate's pick (the first number in any
    entry's name) takes a temporary one."""
    parent = tmp_path / "checkpoints"
    dead, live = 2**22 + 12345, os.getppid()
    for i in (0, 1):
        (parent / f"checkpoint_{i}").mkdir(parents=True)
    (parent / "checkpoint_1").rename(parent / f".checkpoint_1.old-{dead}")  # mid-rename
    for name in (f".checkpoint_1.tmp-{dead}", f".checkpoint_2.tmp-{dead}",
                 f".checkpoint_3.tmp-{live}", f".checkpoint_00.gone-{dead}"):  # rotated
        (parent / name).mkdir()
    stock = max(os.listdir(parent), key=lambda n: int(re.findall(r"[0-9]+", n)[0]))
    assert stock.startswith(".checkpoint_")  # what stock `load_state()` would load
    recover_all(parent)
    assert sorted(os.listdir(parent)) == [f".checkpoint_3.tmp-{live}", "checkpoint_0",
                                          "checkpoint_1"]
    accelerator = SimpleNamespace(project_dir=str(tmp_path))
    assert share_checkpoint.latest_directory(accelerator) == parent / "checkpoint_1"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint_<i> folder in .*: pass"):
        share_checkpoint.latest_directory(SimpleNamespace(project_dir=str(tmp_path / "none")))


def _run(tmp_path: Path, steps: range, rng: dict[str, torch.Tensor], optimizer: str, *,
         load: Path | None = None, save: Path | None = None,
         save_after: int = -1) -> list[torch.Tensor]:
    """Train `tiny_model` on a shuffled loader for `steps` (0-based optimizer steps);
    `rng` receives the global RNG state at the save and right after the load."""
    torch.manual_seed(0)
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (6 * BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH,
                                       shuffle=True)
    model.config.hidden_dropout = 0.0
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800", optimizer=optimizer,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    # A seedable sampler: the shuffle order is a function of (seed, epoch), so a resumed
    # run sees the same order as the straight one (accelerate's own resume recipe).
    acc = Accelerator(cpu=True, plugin=plugin,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    user = (HybridAdamW8bit(model.parameters(), lr=1e-2, min_8bit_numel=0)  # all 8-bit
            if optimizer == "hybrid8bit" else torch.optim.AdamW(model.parameters(), lr=1e-2))
    model, opt, data = acc.prepare(model, user, data)
    if load is not None:
        acc.load_state(str(load))
        rng["loaded"] = torch.get_rng_state()
        data = acc.skip_first_batches(data, steps.start)
    for step, (batch,) in zip(steps, data, strict=False):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step == save_after:
            acc.save_state(str(save))
            rng["saved"] = torch.get_rng_state()
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():  # by parameter: a loaded state dict has its own order
        state = opt.optimizer.state.get(p, {})
        out += [state[k].clone() for k in sorted(state) if torch.is_tensor(state[k])]
    acc.end_training()
    return out


@pytest.mark.parametrize("optimizer", ["hybrid8bit", "keep"])
def test_resume_from_an_atomic_checkpoint_is_bit_identical(tmp_path: Path,
                                                           optimizer: str) -> None:
    ckpt = tmp_path / "ckpt"
    rng: dict[str, torch.Tensor] = {}
    straight = _run(tmp_path, range(4), rng, optimizer, save=ckpt, save_after=1)
    assert (ckpt / PLAN_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    resumed = _run(tmp_path, range(2, 4), rng, optimizer, load=ckpt)
    assert torch.equal(rng["saved"], rng["loaded"])
    assert len(resumed) == len(straight) > 0
    if optimizer == "hybrid8bit":
        assert any(t.dtype == torch.uint8 for t in resumed)  # 8-bit codes were resumed
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
