"""The Trainer's checkpoints written beside training (frontends/trainer_checkpoint.py,
issue 33), one process, in-process Trainer runs of a tiny Qwen2 with a throttled writer:
`_save_checkpoint` returns before the checkpoint is published and the next update waits
for it group by group; the checkpoint at step 2 holds the weights, optimizer state,
scheduler and trainer state of a synchronous save at step 2 bit for bit, in several
shards and an index `from_pretrained` reloads exactly; a resume from it equals the
uninterrupted run bit for bit; with `save_total_limit=1` the older checkpoint goes only
once the newer one is published."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

from lazytrain_accel.checkpoints import asynchronous as async_checkpoint
from lazytrain_accel.checkpoints import share_format as sc
from lazytrain_accel.frontends.transformers import LazyTrainTrainer

STEPS, SAVE_STEPS = 4, 2
#: The tiny model's checkpoint (weights and optimizer state) is ~0.3 MB: at this rate the
#: writer is still writing when the next step's update starts.
SLOW_WRITE_BYTES_PER_S = 60_000.0
SHARD_BYTES = 20_000  # several weight shards and an index


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class _Watch(TrainerCallback):
    """At each save: whether its checkpoint was published when `_save_checkpoint`
    returned, which checkpoints existed then, and its pending save; at the next step's
    end (its update started): whether that save was still being written."""

    def __init__(self) -> None:
        self.trainer: Any = None  # set once built
        self.saves: list[dict[str, Any]] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        out = Path(args.output_dir)
        self.saves.append({
            "step": state.global_step,
            "published": (out / f"checkpoint-{state.global_step}").exists(),
            "present": sorted(p.name for p in out.glob("checkpoint-*")),
            "pending": self.trainer.accelerator.lazytrain.pending_save})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.saves and state.global_step == self.saves[-1]["step"] + 1:
            pending = self.saves[-1]["pending"]
            self.saves[-1]["writing_at_next_update"] = pending is not None and not pending.done


def _train(out: Path, cache: Path, *, mode: str, resume: Path | None = None,
           limit: int | None = None, rate: float = SLOW_WRITE_BYTES_PER_S,
           callback: TrainerCallback | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to="none",
                             max_steps=STEPS, save_steps=SAVE_STEPS, logging_steps=1,
                             disable_tqdm=True, per_device_train_batch_size=4, seed=0,
                             learning_rate=1e-2, save_total_limit=limit)
    watch = _Watch()
    callbacks = [watch] if callback is None else [watch, callback]
    trainer = LazyTrainTrainer(model=model, args=args, train_dataset=_Rows(), callbacks=callbacks,
                               lazytrain_config={
                                   "plan": "checkpoint_all", "hardware": "h800",
                                   "cache_dir": str(cache), "checkpoint_mode": mode,
                                   "checkpoint_max_shard_bytes": SHARD_BYTES,
                                   "checkpoint_write_bytes_per_s": rate})
    for each in callbacks:
        each.trainer = trainer
    losses: list[torch.Tensor] = []
    stock_step = trainer.training_step

    def training_step(*a: Any, **k: Any) -> torch.Tensor:
        loss = stock_step(*a, **k)
        losses.append(loss.detach().clone().reshape(1))
        return loss

    trainer.training_step = training_step
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    optimizer = trainer.accelerator.lazytrain.optimizer
    names = sc.param_names(trainer.model)
    return {"losses": torch.cat(losses), "saves": watch.saves,
            "order": [names[p] for g in optimizer.param_groups for p in g["params"]],
            "weights": {n: t.detach().clone() for n, t in trainer.model.state_dict().items()},
            "state": {names[p]: {k: v.clone() if torch.is_tensor(v) else v
                                 for k, v in s.items()} for p, s in optimizer.state.items()}}


class _NextStepEnded(TrainerCallback):
    """Sets `ended` at the end of the step after the first save (after `_Watch` saw it)."""

    def __init__(self) -> None:
        self.trainer: Any = None  # set once built
        self.ended = threading.Event()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == SAVE_STEPS + 1:
            self.ended.set()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """async: 4 steps, async saves at 2 and 4; sync: the same with synchronous saves;
    resumed: from a copy of async's checkpoint-2 in a folder of its own, save_total_limit=1."""
    root = tmp_path_factory.mktemp("trainer_async")
    ours = logging.getLogger("lazytrain_accel")
    lines, level = _Lines(), ours.level
    ours.addHandler(lines)
    ours.setLevel(logging.INFO)
    stock_wait = async_checkpoint.PendingSave._wait_for_ranks
    next_step = _NextStepEnded()

    def publish_after_the_next_step(save: async_checkpoint.PendingSave) -> None:
        # The update of the step after a save waits for each group's bytes (its gate), so
        # the writer's last group and that step's end race: the first save's publish is
        # held until the step has ended (an event, not a writer slow enough), the
        # precondition of the first test below.
        if save.final.name == f"checkpoint-{SAVE_STEPS}":
            assert next_step.ended.wait(timeout=120), "the step after the save never ended"
        stock_wait(save)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(async_checkpoint.PendingSave, "_wait_for_ranks",
                          publish_after_the_next_step)
            result = {"root": root,
                      "async": _train(root / "async", root / "cache", mode="async",
                                      callback=next_step)}
        result["sync"] = _train(root / "sync", root / "cache", mode="sync")
        (root / "resumed").mkdir()
        shutil.copytree(root / "async" / "checkpoint-2", root / "resumed" / "checkpoint-2")
        result["resumed"] = _train(root / "resumed", root / "cache", mode="async",
                                   resume=root / "resumed" / "checkpoint-2", limit=1)
    finally:
        ours.removeHandler(lines)
        ours.setLevel(level)
    result["lines"] = lines.lines
    return result


def test_the_save_returns_first_and_the_next_update_waits_for_it(runs: dict) -> None:
    first = runs["async"]["saves"][0]
    assert first["step"] == SAVE_STEPS and not first["published"]  # it returned first
    assert first["writing_at_next_update"]  # else this test could not tell a missing wait
    assert first["pending"].update_waited_s > 0  # the update of step 3 waited at a gate
    assert [s["step"] for s in runs["async"]["saves"]] == [2, 4]
    started = [m for m in runs["lines"] if "started (async" in m]
    written = [m for m in runs["lines"] if "written (async" in m]
    assert len(started) == len(written) == 3  # async: 2 saves, resumed: 1
    assert any("written (sync" in m and "checkpoint_mode='sync'" in m for m in runs["lines"])
    leftovers = [p.name for name in ("async", "resumed") for p in (runs["root"] / name).iterdir()
                 if p.name.startswith(".")]
    assert leftovers == []  # no temporary directory or staging folder left


def test_the_async_checkpoint_holds_what_a_sync_one_holds(runs: dict) -> None:
    ours, theirs = runs["root"] / "async" / "checkpoint-2", runs["root"] / "sync" / "checkpoint-2"
    files = {p.name for p in ours.iterdir()}
    shards = [n for n in files if n.startswith("model-")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files
    assert {"config.json", "generation_config.json", "optimizer_share_0.safetensors",
            sc.MANIFEST, "lazytrain_plan.json", "scheduler.pt", "rng_state.pth",
            "trainer_state.json", "training_args.bin"} <= files
    assert not {"model.safetensors", "optimizer.pt"} & files
    # sync keeps the Trainer's own layout
    assert {"model.safetensors", "optimizer.pt"} <= {p.name for p in theirs.iterdir()}
    assert not (theirs / sc.MANIFEST).exists()

    blocking = load_file(theirs / "model.safetensors")
    written = {k: v for shard in shards for k, v in load_file(ours / shard).items()}
    assert written.keys() == blocking.keys()
    for name, tensor in blocking.items():
        assert torch.equal(written[name], tensor), name

    stock = torch.load(theirs / "optimizer.pt", weights_only=False)
    params = runs["sync"]["order"]  # the names of optimizer.pt's parameter indices
    share = sc.read_share(ours / "optimizer_share_0.safetensors", set(params))
    assert set(share) == {params[i] for i in stock["state"]}
    for index, state in stock["state"].items():
        saved = share[params[index]]
        assert list(saved) == list(state), params[index]
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(saved[key]), torch.as_tensor(value)), key
    manifest = sc.read_manifest(ours)
    assert [g["lr"] for g in manifest["optimizer"]["param_groups"]] == [
        g["lr"] for g in stock["param_groups"]]
    assert (torch.load(ours / "scheduler.pt", weights_only=True)
            == torch.load(theirs / "scheduler.pt", weights_only=True))
    assert torch.equal(torch.load(ours / "rng_state.pth", weights_only=False)["cpu"],
                       torch.load(theirs / "rng_state.pth", weights_only=False)["cpu"])
    assert _trainer_state(ours) == _trainer_state(theirs)
    assert _trainer_state(ours)["global_step"] == 2


def _trainer_state(checkpoint: Path) -> dict:
    """trainer_state.json without the measured LazyTrain timings of its log history."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["log_history"] = [{k: v for k, v in e.items() if not k.startswith("lazytrain/")}
                            for e in state["log_history"]]
    return state


def test_from_pretrained_reloads_the_shards_exactly(runs: dict) -> None:
    checkpoint = runs["root"] / "async" / "checkpoint-2"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    blocking = load_file(runs["root"] / "sync" / "checkpoint-2" / "model.safetensors")
    for name, tensor in blocking.items():
        assert torch.equal(reloaded[name], tensor), name


def test_async_saves_change_nothing_and_a_resume_continues_bit_for_bit(runs: dict) -> None:
    straight, sync, resumed = runs["async"], runs["sync"], runs["resumed"]
    assert torch.equal(straight["losses"], sync["losses"])
    assert torch.equal(resumed["losses"], straight["losses"][SAVE_STEPS:])
    for other in (sync, resumed):
        assert other["weights"].keys() == straight["weights"].keys()
        for name, tensor in straight["weights"].items():
            assert torch.equal(other["weights"][name], tensor), name
        assert other["state"].keys() == straight["state"].keys()
        for name, state in straight["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(other["state"][name][key]),
                                   torch.as_tensor(value)), (name, key)


def test_rotation_waits_for_the_new_checkpoint_to_be_published(runs: dict) -> None:
    (save,) = runs["resumed"]["saves"]
    assert save["step"] == STEPS and not save["published"]
    assert save["present"] == ["checkpoint-2"]  # the older one outlives the save's start
    out = runs["root"] / "resumed"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    for name in ("model.safetensors.index.json", "optimizer_share_0.safetensors"):
        assert ((out / "checkpoint-4" / name).read_bytes()
                == (runs["root"] / "async" / "checkpoint-4" / name).read_bytes()), name


class _FailAfterFirstSave(TrainerCallback):
    """Once the first checkpoint is published, every later write fails (a full disk)."""

    def __init__(self) -> None:
        self.trainer: Any = None  # set once built
        self.failing = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.failing:
            self.trainer.accelerator.lazytrain_wait_for_checkpoint()
            self.failing = True


def test_a_failed_save_is_raised_by_train_and_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    fail = _FailAfterFirstSave()
    stock_bytes = async_checkpoint.layout.tensor_bytes

    def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> memoryview:
        if fail.failing:
            raise OSError(28, "No space left on device")
        return stock_bytes(tensor, dtype)

    monkeypatch.setattr(async_checkpoint.layout, "tensor_bytes", tensor_bytes)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match=r"checkpoint-4 failed, the previous checkpoint .*"
                                           r"kept: OSError.*No space"):
        _train(out, tmp_path / "cache", mode="async", rate=0.0, callback=fail)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert sc.read_manifest(out / "checkpoint-2") is not None  # published whole
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # no temporary left


class _RaiseAfterSave(TrainerCallback):
    """An error in the step after the first save, while its writer is still pending."""

    def __init__(self) -> None:
        self.trainer: Any = None  # set once built
        self.published_at_error: bool | None = None
        self.raised = threading.Event()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == SAVE_STEPS + 1:
            self.published_at_error = (Path(args.output_dir) / "checkpoint-2").exists()
            self.raised.set()
            raise ValueError("a bad batch")


def test_an_error_in_training_lets_the_pending_save_finish_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    error, out = _RaiseAfterSave(), tmp_path / "out"
    stock_wait = async_checkpoint.PendingSave._wait_for_ranks

    def publish_after_the_error(save: async_checkpoint.PendingSave) -> None:
        # The update of the step after the save waits for each group's bytes (its gate),
        # so the writer's last group and the step's end race: the publish is held until
        # the error is raised (an event, not a writer slow enough).
        assert error.raised.wait(timeout=120), "the step after the save never ended"
        stock_wait(save)

    monkeypatch.setattr(async_checkpoint.PendingSave, "_wait_for_ranks", publish_after_the_error)
    with pytest.raises(ValueError, match="a bad batch"):
        # uncapped: the publish is held, not the writer slowed
        _train(out, tmp_path / "cache", mode="async", callback=error, rate=0.0)
    assert error.published_at_error is False  # the save was still pending
    assert get_last_checkpoint(str(out)) in (None, str(out / "checkpoint-2"))
    error.trainer.accelerator.lazytrain_wait_for_checkpoint()  # what the exit waits for
    assert sc.read_manifest(out / "checkpoint-2") is not None  # published whole
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]


def test_a_new_trainer_removes_what_a_killed_async_save_left(tmp_path: Path) -> None:
    from lazytrain_accel.frontends.trainer_checkpoint import remove_dead_staging

    dead = _dead_pid()
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / f".checkpoint-8.tmp-{dead}").mkdir()  # killed while writing checkpoint-8
    (tmp_path / f".checkpoint-6.old-{dead}").mkdir()  # killed between a re-save's renames
    remove_dead_staging(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]


def _dead_pid() -> int:
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
