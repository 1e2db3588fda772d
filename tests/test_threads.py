"""Sizing torch's intra-op pool (and so the update kernel's) for the free cores."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from lazytrain_accel import LazyTrainPlugin, threads


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> None:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("cores", "busy", "gpu", "expected"), [
    (2, 0, False, 2),  # quiet 2-core CPU run: both cores compute
    (2, 1, False, 1),  # one competing busy process: one thread, no spinning OpenMP pair
    (16, 0, True, 15),  # GPU run: one core for the thread that launches kernels
    (16, 4, True, 11),
    (1, 0, True, 1),  # never below one
])
def test_rule(cores: int, busy: int, gpu: bool, expected: int) -> None:
    assert threads.thread_count(cores=cores, busy_elsewhere=busy, gpu=gpu) == expected


def test_busy_cores_exclude_this_process_and_are_capped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Over the quarter second the machine was busy 0.6 CPU s, 0.35 s of them ours:
    # others kept one core busy.
    machine, own = iter([100.0, 100.6]), iter([5.0, 5.35])
    monkeypatch.setattr(threads, "_machine_busy_s", lambda: next(machine))
    monkeypatch.setattr(threads, "_own_cpu_s", lambda: next(own))
    clock = iter([0.0, threads.SAMPLE_S])
    monkeypatch.setattr(threads, "time", SimpleNamespace(sleep=lambda s: None,
                                                         perf_counter=lambda: next(clock)))
    assert threads.busy_cores_elsewhere(4) == 1
    monkeypatch.setattr(threads, "_other_processes_cpu_s", lambda window_s: 9.0 * window_s)
    assert threads.busy_cores_elsewhere(4) == 3  # this process keeps one


def test_without_proc_stat_the_load_average_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_machine_busy_s", lambda: None)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.4, 0.0, 0.0))
    assert threads.busy_cores_elsewhere(4) == 1


def test_the_machine_reading_is_real_on_linux() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    assert threads._machine_busy_s() > 0
    assert 0 <= threads.busy_cores_elsewhere(threads.usable_cores()) < threads.usable_cores()


def test_apply_sizes_the_pool_the_update_thread_also_uses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 3)
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda cores: 1)
    assert threads.apply_threads(0, device=torch.device("cpu")) == 2
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    assert torch.get_num_threads() == 2 and seen == [2]  # a new thread (the update) too
    assert threads.apply_threads(1, device=torch.device("cpu")) == 1


def test_ranks_on_one_machine_share_its_cores_unless_pinned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda cores: 0)
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert threads.cores_for_this_process() == 4
    assert threads.apply_threads(0, device=torch.device("cuda")) == 3  # 4 - the launcher
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)  # the launcher pinned 4 cores
    assert threads.cores_for_this_process() == 4


def test_omp_num_threads_is_the_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert threads.apply_threads(0, device=torch.device("cpu")) == 1


def test_the_knob_is_a_config_field_with_its_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_THREADS", "3")
    assert LazyTrainPlugin().threads == 3
    monkeypatch.setenv("LAZYTRAIN_THREADS", "-1")
    with pytest.raises(ValueError, match="threads=-1 must be >= 0"):
        LazyTrainPlugin()


def test_prepare_applies_the_setting(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lazytrain_accel import Accelerator

    torch.set_num_threads(2)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1))
    monkeypatch.setenv("LAZYTRAIN_THREADS", "1")
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    accelerator = Accelerator(cpu=True, plugin=plugin)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert torch.get_num_threads() == 1
