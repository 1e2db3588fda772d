"""Checkpoints written beside training (checkpoints/asynchronous.py), one process:
the checkpoint equals a blocking save at the same step byte for byte, and a resume from it
equals the uninterrupted run bit for bit, while the writer (throttled) is still writing
when the next updates run, so those updates had to wait for it group by group; a kill -9
at random moments of a save leaves the previous checkpoint as the latest, loadable; a
writer error keeps the previous checkpoint and lets the waiting updates go on."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from fault_helpers import BATCH, SEQ, VOCAB, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.checkpoints import asynchronous as async_checkpoint
from lazytrain_accel.checkpoints import resume
from lazytrain_accel.checkpoints import share_format as sc
from lazytrain_accel.checkpoints.atomic import recover
from lazytrain_accel.optim import HybridAdamW8bit

#: The tiny model's checkpoint is ~0.2 MB: at this rate the writer spans the next steps.
SLOW_WRITE_BYTES_PER_S = 50_000.0
SAVE_AT = 1
KILLS = 5
SAVE_WINDOW_S = 4.0  # async_save_child.py's slow save of checkpoint_1 takes about this


def _run(tmp_path: Path, steps: range, *, mode: str = "async", save: Path | None = None,
         load: Path | None = None, out: dict | None = None) -> list[torch.Tensor]:
    """Train `tiny_model` on a shuffled loader; save after step `SAVE_AT` (0-based) to
    `save`, or resume from `load`. Returns the losses, then the masters and the state."""
    torch.manual_seed(0)
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (6 * BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH,
                                       shuffle=True)
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800", checkpoint_mode=mode,
                             checkpoint_write_bytes_per_s=SLOW_WRITE_BYTES_PER_S,
                             checkpoint_max_shard_bytes=100_000,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    user = HybridAdamW8bit(model.parameters(), lr=1e-2, min_8bit_numel=0)
    model, opt, data = acc.prepare(model, user, data)
    if load is not None:
        acc.load_state(str(load))
        data = acc.skip_first_batches(data, steps.start)
    losses = []
    for step, (batch,) in zip(steps, data, strict=False):
        loss = model(input_ids=batch, labels=batch).loss
        losses.append(loss.detach().reshape(1))
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if out is not None and step == SAVE_AT + 1:  # this update started beside the save
            out["writing_at_next_update"] = not out["pending"].done
        opt.zero_grad()
        if step == SAVE_AT and save is not None:
            acc.save_state(str(save))
            if out is not None:
                out["pending"] = acc.lazytrain.pending_save
                out["published_at_return"] = save.exists()
    result = [torch.cat(losses)] + [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        state = opt.optimizer.state.get(p, {})
        result += [state[k].clone() for k in sorted(state) if torch.is_tensor(state[k])]
    acc.end_training()
    return result


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_async_save_equals_a_blocking_one_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    seen: dict = {}
    straight = _run(tmp_path, range(5), save=tmp_path / "async", out=seen)
    pending = seen["pending"]
    assert pending is not None and not seen["published_at_return"]  # it returned first
    assert seen["writing_at_next_update"]  # else this test could not tell a missing wait
    assert pending.update_waited_s > 0  # the next update waited at a group's gate
    _run(tmp_path, range(SAVE_AT + 1), mode="sync", save=tmp_path / "sync")
    written, blocking = _files(tmp_path / "async"), _files(tmp_path / "sync")
    assert "model.safetensors.index.json" in written and len(
        [n for n in written if n.startswith("model-")]) >= 2
    assert written.keys() == blocking.keys()
    for name, content in blocking.items():
        assert written[name] == content, name
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    resumed = _run(tmp_path, range(SAVE_AT + 1, 5), load=tmp_path / "async")
    assert torch.equal(resumed[0], straight[0][SAVE_AT + 1:])  # the losses
    assert len(resumed) == len(straight)
    for a, b in zip(straight[1:], resumed[1:], strict=True):
        assert torch.equal(a, b)


def test_the_writer_writes_the_masters_while_the_next_forward_swaps_the_weights(
        tmp_path: Path) -> None:
    """A layer the next forward runs points its parameters' `.data` at the weight pool's
    slot, which the pool refills with other layers: the writer, reaching that layer's
    weights then, must still write the masters (it wrote a torn tensor on a CPU: the
    2-rank crash test's `layers.0.self_attn.q_proj`). Here every parameter is pointed at
    zeros while the throttled writer runs."""
    torch.manual_seed(0)
    model = tiny_model()
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800",
                             checkpoint_write_bytes_per_s=SLOW_WRITE_BYTES_PER_S,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=1e-2))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    acc.save_state(str(tmp_path / "ckpt"))
    masters = {name: p.data for name, p in model.named_parameters()}
    assert not acc.lazytrain.pending_save.done  # the writer is still writing
    for p in model.parameters():  # what acquiring a layer does, with other bytes
        p.data = torch.zeros_like(p.data)
    acc.lazytrain_wait_for_checkpoint()
    for name, p in model.named_parameters():
        p.data = masters[name]
    fresh = tiny_model(seed=7)
    resume.load_weights(fresh, tmp_path / "ckpt", loads=lambda t: True)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, masters[name]), name
    acc.end_training()


def _check_latest_loads(root: Path) -> tuple[str, bool]:
    """Undo what a killed save left; every checkpoint left is complete and loads (the
    weights into a fresh model, the optimizer state into a fresh optimizer). Returns the
    latest's name and whether a killed save had left a temporary directory."""
    saves = {f.name.split(".")[1] for f in root.iterdir() if f.name.startswith(".")}
    for name in saves:  # what the next save into `name`, or a load of it, does first
        recover(root / name)
    folders = sorted((f for f in root.iterdir() if f.name.startswith("checkpoint_")),
                     key=lambda f: int(f.name.rsplit("_", 1)[-1]))
    assert not [f.name for f in root.iterdir() if f.name.startswith(".")]  # temps gone
    latest = folders[-1]
    manifest = sc.read_manifest(latest)
    assert manifest is not None, f"{latest.name} was published without its manifest"
    model = tiny_model(seed=7)
    optimizer = HybridAdamW8bit(model.parameters(), lr=1.0)
    resume.load_weights(model, latest, loads=lambda t: True)
    resume.load_optimizer(optimizer, latest, manifest, sc.param_names(model), lambda p: True,
                          world_size=1)
    assert len(optimizer.state) == len(list(model.parameters()))
    return latest.name, bool(saves)


def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """kill -9 at a random moment of the save of checkpoint_1, in 5 runs side by side."""
    seed = int(time.time())
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(Path(__file__).parent / "async_save_child.py"),
                              str(tmp_path), str(KILLS)], stdout=subprocess.PIPE, env=env,
                             text=True, start_new_session=True)
    timers = []
    try:
        for _ in range(KILLS):
            word, pid = child.stdout.readline().split()  # a run has started its save
            assert word == "saving"
            timers.append(threading.Timer(rng.uniform(0.0, SAVE_WINDOW_S), os.kill,
                                          (int(pid), signal.SIGKILL)))
            timers[-1].start()
        child.wait(timeout=120)  # it ends when every run is killed
    finally:
        for timer in timers:
            timer.join()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # none left running, whatever happened
        child.wait()
    found = [_check_latest_loads(tmp_path / f"run{i}" / "checkpoints") for i in range(KILLS)]
    assert {name for name, _ in found} <= {"checkpoint_0", "checkpoint_1"}, (seed, found)
    assert any(left for _, left in found), (seed, found)  # some kill landed mid-save


def _accelerator(masters: SimpleNamespace) -> tuple[SimpleNamespace, list]:
    model = tiny_model()
    optimizer = HybridAdamW8bit(model.parameters(), lr=1e-2)
    groups = [list(model.parameters())[:3], list(model.parameters())[3:]]
    plugin = SimpleNamespace(checkpoint_dtype="auto", checkpoint_max_shard_bytes=10**9,
                             checkpoint_write_bytes_per_s=0.0)
    acc = SimpleNamespace(lazytrain=SimpleNamespace(
        engine=SimpleNamespace(steps=SimpleNamespace(update_groups=groups, peers=None, remote=None),
                               masters=masters),
        model=model, optimizer=optimizer), lazytrain_plugin=plugin, step=1)
    return acc, groups


@pytest.mark.parametrize("failing", ["write", "copy_file_range"])
def test_a_writer_error_keeps_the_previous_checkpoint_and_frees_the_updates(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """A full drive at a write through the staging buffer, or at a copy file to file of
    state homed on NVMe (issue 44 item 4: here the first group's masters, in a file)."""
    homed: dict[object, async_checkpoint.FileRange] = {}
    masters = SimpleNamespace(in_file=lambda param, name: 1 if param in homed and name is None
                              else None, read_values=lambda layer: {},
                              file_range=lambda param, name: homed.get(param))
    acc, groups = _accelerator(masters)
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "previous.txt").write_text("kept")
    if failing == "write":
        calls = {"n": 0}
        stock_bytes = async_checkpoint.layout.tensor_bytes

        def fail_fourth(tensor: torch.Tensor, dtype: torch.dtype | None) -> memoryview:
            calls["n"] += 1
            if calls["n"] == 4:
                raise OSError(28, "No space left on device")
            return stock_bytes(tensor, dtype)

        monkeypatch.setattr(async_checkpoint.layout, "tensor_bytes", fail_fourth)
    else:
        state = tmp_path_factory.mktemp("nvme") / "optim-1.bin"
        with open(state, "wb") as f:  # the first group's fp32 masters, back to back
            for p in groups[0]:
                homed[p] = async_checkpoint.FileRange(state, f.tell(), 4 * p.numel(),
                                                      torch.float32)
                f.write(p.detach().numpy().tobytes())

        def full(*_: object) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(async_checkpoint.direct.os, "copy_file_range", full)
    pending = async_checkpoint.start_save(acc, final, lambda d: None, on_published=lambda: None)
    with pytest.raises(RuntimeError, match=r"previous checkpoint .* kept: OSError.*No space"):
        pending.wait()
    waiter = threading.Thread(target=lambda: [pending.wait_written(g)
                                              for g in range(len(groups))], daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive()  # no update is left waiting on a failed save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    assert [p.name for p in final.iterdir()] == ["previous.txt"]
