"""One optimizer step, top-down: few Python frames between `optimizer.step()` and the
update kernel (issue #31 item 2)."""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.engine.step.worker import UpdateWorker
from lazytrain_accel.optim import HybridAdamW8bit, reference

#: The most frames `optimizer.step()` may pass through on its way to the kernel: one more
#: than when the run replaced the hybrid operator's `step` on the instance (issue #46):
#: its own `step`, inside torch's wrapper that runs the step hooks, hands over to the run.
MAX_FRAMES = 7


def _tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _accelerator(tmp_path: Path, **plugin_kwargs: Any) -> Accelerator:
    """The Accelerator with a LazyTrain plugin every test here prepares its model with."""
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"),
                             **plugin_kwargs)
    return Accelerator(cpu=True, plugin=plugin)


def _frames(frame: FrameType | None) -> list[str]:
    """The stack from `frame` outwards, as "file:function", innermost first."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{code.co_name}")
        frame = frame.f_back
    return out


def _user_step(optimizer: Any) -> None:
    optimizer.step()  # the user's call: the frames counted start below this one


class _Recorder:
    """Stacks at each kernel call and at each hand-off to the update worker."""

    def __init__(self) -> None:
        self.kernel_calls: list[tuple[threading.Thread, list[str]]] = []
        self.submits: list[list[str]] = []

    def kernel(self, fn: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.kernel_calls.append((threading.current_thread(),
                                      _frames(sys._getframe(1))))
            return fn(*args, **kwargs)
        return recorded


class _Kernel:
    """The native kernel, its entry recorded."""

    def __init__(self, kernel: Any, recorder: _Recorder) -> None:
        self.adamw8bit_step = recorder.kernel(kernel.adamw8bit_step)


def _below_user(stack: list[str]) -> list[str]:
    """The frames inside `optimizer.step()`: innermost first, up to the user's frame."""
    return stack[:stack.index(f"{Path(__file__).name}:_user_step")]


def _thread_frames(stack: list[str]) -> list[str]:
    """The worker's frames from the job it runs in: threading.py's and the worker's own
    loop (worker.py) dropped, as its bootstrap."""
    return [f for f in stack if not f.startswith(("threading.py:", "worker.py:"))]


def frames_to_kernel(recorder: _Recorder, user_thread: threading.Thread) -> list[list[str]]:
    """Each kernel call's chain of frames, innermost first (see the test's docstring)."""
    chains = []
    for thread, stack in recorder.kernel_calls:
        if thread is user_thread:
            chains.append(_below_user(stack))
        else:
            (submit,) = recorder.submits  # the one hand-off of the step
            chains.append(_thread_frames(stack) + _below_user(submit))
    return chains


@pytest.mark.parametrize("overlap_step", [True, False])
def test_optimizer_step_reaches_the_kernel_in_few_frames(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap_step: bool) -> None:
    """Frames counted, for every update-kernel call of one step (the most of them):

    * the kernel is the function that does a tensor's update: the native
      `adamw8bit_step`, or the torch paths `reference.adamw8bit_update_` /
      `reference.adamw_fp32_update_`; the frame that calls it is the last one counted;
    * on the training thread: every frame from the one the user's `optimizer.step()`
      enters (accelerate's `AcceleratedOptimizer.step`) to the kernel's caller;
    * on the update thread: the frames of the submitting chain, from the one
      `optimizer.step()` enters to the one that calls `UpdateWorker.submit` (the
      hand-off), plus the worker's frames from its target (its loop) to the kernel's caller
      (threading.py's bootstrap frames are not counted);
    * no LR scheduler (its wrapper of `optimizer.step` adds one frame).
    """
    model = _tiny_model()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    acc = _accelerator(tmp_path, overlap_step=overlap_step)
    model, optimizer = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=1e-3,
                                                          max_grad_norm=1.0))
    recorder = _Recorder()
    inner = optimizer.optimizer
    if inner._kernel is not None:
        monkeypatch.setattr(inner, "_kernel", _Kernel(inner._kernel, recorder))
    for name in ("adamw8bit_update_", "adamw_fp32_update_"):
        monkeypatch.setattr(reference, name, recorder.kernel(getattr(reference, name)))
    submit = UpdateWorker.submit

    def recorded_submit(worker: UpdateWorker, job: Any) -> None:
        recorder.submits.append(_frames(sys._getframe(1)))
        submit(worker, job)

    acc.backward(model(input_ids=ids, labels=ids).loss)
    monkeypatch.setattr(UpdateWorker, "submit", recorded_submit)
    _user_step(optimizer)
    monkeypatch.setattr(UpdateWorker, "submit", submit)
    acc.wait_for_everyone()  # the update thread has made its kernel calls

    chains = frames_to_kernel(recorder, threading.current_thread())
    assert chains, "the step made no kernel call"
    longest = max(chains, key=len)
    assert len(longest) <= MAX_FRAMES, (
        f"optimizer.step() passes through {len(longest)} frames to the kernel "
        f"(at most {MAX_FRAMES}): {' <- '.join(longest)}")
    acc.end_training()


@pytest.mark.parametrize("optimizer_class", [HybridAdamW8bit, torch.optim.AdamW])
def test_a_scheduler_built_before_prepare_sees_the_step(tmp_path: Path,
                                                        optimizer_class: type) -> None:
    """The step no longer calls the scheduler's wrapper of `optimizer.step` (the hybrid
    operator's own, bypassed; the user's AdamW, replaced): it must still mark the step
    for it (torch's `_opt_called`), or torch warns at `scheduler.step()`: the warning
    fails this test, also when torch renames that field."""
    model = _tiny_model()
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    acc = _accelerator(tmp_path)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
    acc.end_training()


class _Peers:
    """A node store's peers with no foreign groups, counting what the step tells them."""

    def __init__(self) -> None:
        self.foreign_groups: list[int] = []
        self.begun = self.published_all = 0

    def begin_step(self) -> None:
        self.begun += 1

    def publish(self, group: int) -> None:
        pass

    def publish_all(self) -> None:
        self.published_all += 1

    def is_ready(self, group: int) -> bool:
        return True

    def wait(self, group: int) -> None:
        pass

    def wait_all(self) -> None:
        pass


@pytest.mark.parametrize("overlap_step", [True, False])
def test_norms_once_and_the_peers_step_begins_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap_step: bool) -> None:
    """A step after `clip_grad_norm_` measures the global norm once (the clip's cached
    norm is reused, not thrown away by setting the engine's norms again), and the peers'
    step begins once per applied step, inline or overlapped."""
    from lazytrain_accel.optim import hybrid_adamw8bit

    model = _tiny_model()
    acc = _accelerator(tmp_path, overlap_step=overlap_step)
    model, optimizer = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=1e-3))
    peers = _Peers()
    acc.lazytrain.engine.steps.peers = peers
    norms = []
    measure = hybrid_adamw8bit.total_grad_norm
    monkeypatch.setattr(hybrid_adamw8bit, "total_grad_norm",
                        lambda *a: norms.append(1) or measure(*a))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    acc.wait_for_everyone()
    assert len(norms) == 2, f"{len(norms)} global norm passes in 2 steps"
    assert peers.begun == 2
    assert peers.published_all == (0 if overlap_step else 2)
    acc.end_training()


def test_a_kept_optimizers_step_returns_its_closures_loss(tmp_path: Path) -> None:
    """optimizer="keep": the optimizer's own `step(closure)` runs behind the guard, and
    what it returns (the closure's loss) comes back to the caller."""
    model = _tiny_model()
    acc = _accelerator(tmp_path, optimizer="keep")
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    loss = optimizer.optimizer.step(lambda: torch.tensor(3.0))  # accelerate's returns None
    assert loss is not None and float(loss) == 3.0
    assert acc.lazytrain.guard.steps == 1
    acc.end_training()


def test_the_update_overlaps_by_default_where_the_device_is_not_the_hosts_cores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`overlap_step="auto"` (the default) runs the update inline on a CPU device, whose
    compute takes every core, and on its thread beside the next forward on a GPU and on
    the emulated async device; True and False are kept as set."""
    from lazytrain_accel.run.step import installed_step, update_overlaps

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert not update_overlaps("auto", device=cpu, emulated=False)
    assert update_overlaps("auto", device=cpu, emulated=True)
    assert update_overlaps("auto", device=gpu, emulated=False)
    assert update_overlaps(True, device=cpu, emulated=False)
    assert not update_overlaps(False, device=gpu, emulated=False)
    monkeypatch.delenv("LAZYTRAIN_OVERLAP_STEP", raising=False)  # the suite sets it on
    monkeypatch.delenv("LAZYTRAIN_EMULATE_ASYNC", raising=False)
    acc = _accelerator(tmp_path, checkpoint_mode="async")
    model = _tiny_model()
    acc.prepare(model, HybridAdamW8bit(model.parameters()))
    assert acc.lazytrain_plugin.overlap_step == "auto"
    step = installed_step(acc.lazytrain.optimizer)
    assert step is not None and not step.overlapped
    assert not acc.lazytrain_saves_async()  # no per-group wait to order a save after
    acc.end_training()
