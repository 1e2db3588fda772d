"""An NVMe write or read failing mid-step (the real file calls fail, as on a full or dying
disk): a clear error, no update applied, no file left, the last checkpoint loadable."""

from __future__ import annotations

import builtins
import errno
import time
from pathlib import Path

import pytest
import torch
from fault_helpers import NUM_LAYERS, loader, plan_json, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.engine.memory import nvme
from lazytrain_accel.engine.memory.nvme import NvmeIOError
from lazytrain_accel.planning.plan import Home


class _FailingFile:
    """A real file whose write stores half the bytes and then fails with ENOSPC."""

    def __init__(self, f: object) -> None:
        self._f = f

    def write(self, data: memoryview) -> int:
        half = memoryview(data).cast("B")[: len(memoryview(data).cast("B")) // 2]
        self._f.write(half)
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def _inject(monkeypatch: pytest.MonkeyPatch, mode: str, *, after: int) -> dict[str, int]:
    """Make the engine's `open(path, mode)` fail from its `after`-th call on."""
    calls = {"n": 0}

    def faulty_open(path: object, how: str = "r", *args: object, **kwargs: object) -> object:
        if how != mode:
            return builtins.open(path, how, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] <= after:
            return builtins.open(path, how, *args, **kwargs)
        if how == "wb":
            return _FailingFile(builtins.open(path, how, *args, **kwargs))
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(nvme, "open", faulty_open, raising=False)
    return calls


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [v.clone() for v in s.values() if torch.is_tensor(v)]
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _prepared(tmp_path: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer,
                                       torch.utils.data.DataLoader]:
    """The tiny model prepared with every inner boundary on NVMe under `tmp_path`."""
    model = tiny_model()
    plugin = LazyTrainPlugin(plan=plan_json(tmp_path, model, Home.NVME), hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    return acc, *acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader())


@pytest.mark.parametrize(("mode", "words"), [("wb", "NVMe write of activation file"),
                                             ("rb", "NVMe read of activation file")])
def test_failed_io_mid_step_applies_nothing_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, words: str) -> None:
    acc, model, opt, data = _prepared(tmp_path)
    batches = [b for (b,) in data]

    def step(batch: torch.Tensor) -> None:
        loss = model(input_ids=batch, labels=batch).loss
        if mode == "rb":  # let the writes finish, so the backward must read the files (a
            # boundary whose write is still in flight is reloaded from its host copy)
            acc.lazytrain.engine.synchronize()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    step(batches[0])
    acc.save_state(str(tmp_path / "ckpt"))
    saved = _state(model, opt.optimizer)
    calls = _inject(monkeypatch, mode, after=1)  # the second file of step 2 fails
    with pytest.raises(NvmeIOError, match=words) as info:
        step(batches[1])
    text = str(info.value)
    assert "weights and optimizer state are unchanged" in text and str(tmp_path) in text
    assert ("No space left" in text) == (mode == "wb") and calls["n"] >= 2
    assert _equal(_state(model, opt.optimizer), saved)  # no partial update
    acc.lazytrain.engine.synchronize()
    assert not list((tmp_path / "nvme").rglob("*.bin"))  # partial and whole files gone
    assert acc.lazytrain.engine.stats().current_bytes["nvme"] == 0  # and accounted so
    # The checkpoint loads, and training goes on from it once the disk works again.
    monkeypatch.undo()
    opt.zero_grad()
    acc.load_state(str(tmp_path / "ckpt"))
    assert _equal(_state(model, opt.optimizer), saved)
    step(batches[1])
    assert not _equal(_state(model, opt.optimizer), saved)
    acc.lazytrain.engine.synchronize()
    assert not list((tmp_path / "nvme").rglob("*.bin"))
    acc.end_training()


def test_a_write_still_running_when_the_backward_takes_its_boundary_fails_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward takes the last boundary from its host copy while its write is still
    running; that write then fails. The error must still end the step before the update
    (it was lost: the step went on as if the disk were fine)."""
    acc, model, opt, data = _prepared(tmp_path)
    batch = next(iter(data))[0]
    saved = _state(model, opt.optimizer)
    slow_write_s, calls = 0.5, {"n": 0}

    class _SlowFailingFile(_FailingFile):
        def write(self, data: memoryview) -> int:
            time.sleep(slow_write_s)  # still running when the backward reaches it
            return super().write(data)

    def faulty_open(path: object, how: str = "r", *args: object, **kwargs: object) -> object:
        if how == "wb":
            calls["n"] += 1
            if calls["n"] == NUM_LAYERS - 1:  # the last boundary's write
                return _SlowFailingFile(builtins.open(path, how, *args, **kwargs))
        return builtins.open(path, how, *args, **kwargs)

    monkeypatch.setattr(nvme, "open", faulty_open, raising=False)
    loss = model(input_ids=batch, labels=batch).loss
    with pytest.raises(NvmeIOError, match="No space left"):
        acc.backward(loss)
    assert calls["n"] == NUM_LAYERS - 1
    assert _equal(_state(model, opt.optimizer), saved)
    acc.lazytrain.engine.synchronize()
    assert not list((tmp_path / "nvme").rglob("*.bin"))
    acc.end_training()
