"""The engine's async code paths, run on the emulated async device, over several seeds.

A representative subset of the equivalence suite reruns with `emulated` (one run per seed
in conftest's EMULATION_SEEDS): results must equal the synchronous CPU run bit for bit.
Then a wait is removed through a test hook, and the emulation must catch it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from engine_helpers import batches, build_model, make_plan
from test_equivalence import train_pair

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.device.emulation import (
    BufferReuseError,
    EmulatedStreams,
    EmulationSettings,
)

CPU = torch.device("cpu")

# Every home kind and transfer stage (mixed: CPU + NVMe + recompute; all_nvme; offload_all),
# a family with dropout (opt), positional layer calls (gpt2), accumulation.
CASES = [("llama", "mixed", 1), ("gpt2", "all_nvme", 1), ("opt", "offload_all", 1),
         ("qwen2", "mixed", 2)]


@pytest.fixture(scope="module")
def synchronous_run(tmp_path_factory: pytest.TempPathFactory):
    """Each case's synchronous CPU run, trained once for all seeds (a seed changes only the
    emulation): its losses and its final parameters."""
    runs: dict[tuple[str, str, int], tuple[list[float], list[torch.Tensor]]] = {}

    def run(arch: str, kind: str, accumulation: int) -> tuple[list[float], list[torch.Tensor]]:
        key = (arch, kind, accumulation)
        if key not in runs:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("LAZYTRAIN_EMULATE_ASYNC", "0")
                _, losses, _, model, engine = train_pair(
                    arch, kind, tmp_path_factory.mktemp("sync"), accumulation=accumulation)
            assert not engine.streams.is_async
            runs[key] = (losses, [p.detach().clone() for p in model.parameters()])
            engine.detach()
        return runs[key]

    return run


@pytest.mark.parametrize(("arch", "kind", "accumulation"), CASES)
def test_emulated_run_equals_the_synchronous_run_exactly(arch, kind, accumulation, emulated,
                                                         synchronous_run, tmp_path):
    losses_ref, losses, _, model, engine = train_pair(arch, kind, tmp_path / "emulated",
                                                        accumulation=accumulation)
    assert isinstance(engine.streams, EmulatedStreams) and engine.streams.seed == emulated
    torch.testing.assert_close(losses, losses_ref, rtol=1e-5, atol=1e-6)  # vs plain PyTorch
    engine.detach()
    sync_losses, sync_parameters = synchronous_run(arch, kind, accumulation)
    assert losses == sync_losses
    for p, q in zip(model.parameters(), sync_parameters, strict=True):
        assert torch.equal(p, q)


def _emulated_engine(tmp_path, *, seed: int, **rates: float):
    model = build_model("llama", 10)
    settings = EmulationSettings(seed=seed, link_bytes_per_s=rates)
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path),
                    emulation=settings)
    return model, engine


def test_a_removed_compute_wait_reads_poisoned_weights(tmp_path, monkeypatch):
    # slow weight loads: every copy is still in flight when compute would read it
    model, engine = _emulated_engine(tmp_path, seed=3, h2d=2e6)
    monkeypatch.setattr(engine.streams, "compute_waits", lambda event: None)
    ids = batches(1)[0]
    assert torch.isnan(model(input_ids=ids, labels=ids).loss)


def test_a_removed_host_wait_on_weight_staging_raises(tmp_path, monkeypatch):
    model, engine = _emulated_engine(tmp_path, seed=4, h2d=2e6)
    monkeypatch.setattr(engine.streams, "host_waits", lambda event: None)
    ids = batches(1)[0]
    with pytest.raises(BufferReuseError, match="LAZYTRAIN_EMULATE_SEED=4"):
        model(input_ids=ids, labels=ids)


def test_gradient_staging_reused_before_its_drain_raises(tmp_path, monkeypatch):
    model, engine = _emulated_engine(tmp_path, seed=5, d2h=2e6)
    monkeypatch.setattr(engine.sink, "_drain", lambda slot: None)  # the fold-and-wait
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(BufferReuseError, match="LAZYTRAIN_EMULATE_SEED=5"):
        loss.backward()


def test_a_failure_under_the_emulation_names_its_seed(tmp_path):
    """A test that fails under LAZYTRAIN_EMULATE_ASYNC=1 reports the seed that replays it."""
    here = Path(__file__).parent
    (tmp_path / "conftest.py").write_text((here / "conftest.py").read_text())
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        def test_fails():
            assert False, "a deliberately failing test"
    """))
    env = {**os.environ, "LAZYTRAIN_EMULATE_ASYNC": "1", "LAZYTRAIN_EMULATE_SEED": "17",
           "PYTHONPATH": os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "emulated async device" in out.stdout
    assert "LAZYTRAIN_EMULATE_ASYNC=1 LAZYTRAIN_EMULATE_SEED=17" in out.stdout


def test_the_host_work_per_transfer_is_timed_and_gradients_keep_their_storage(tmp_path):
    """On an async device the training thread stages each weight load and folds each
    layer's gradients (`StepStats.host_work_s`, the planner's `stage_s` and `fold_s`):
    their bytes are the links' own, and `.grad` keeps one storage across steps (a fresh
    one each step faulted in every page on the training thread)."""
    model, engine = _emulated_engine(tmp_path, seed=0)
    ids = batches(1)[0]
    storage: list[list[int]] = []
    for _ in range(2):
        engine.reset_stats()
        model(input_ids=ids, labels=ids).loss.backward()
        engine.synchronize()
        stats = engine.stats()
        assert stats.host_work_bytes["weights_stage"] == stats.transfer_bytes["weights_h2d"] > 0
        assert stats.host_work_bytes["grads_fold"] == stats.transfer_bytes["grads_d2h"] > 0
        assert all(seconds > 0 for seconds in stats.host_work_s.values())
        layers = [p for j in range(1, 11) for p in engine.layer_params(j)]
        storage.append([p.grad.data_ptr() for p in layers])
        model.zero_grad(set_to_none=True)
    assert storage[0] == storage[1]
    assert engine.sink.kept_bytes() == stats.host_work_bytes["grads_fold"]  # fp32 both
    engine.release_grads(layers)  # a split update's non-owner keeps none of them
    assert engine.sink.kept_bytes() == 0 and all(p.grad is None for p in layers)
    engine.detach()
