"""One long-lived update worker per run: every step's update on the same thread, an error
raised at the next wait, the thread joined when the engine detaches (issue #46 item 2)."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import batches, build_model, make_plan
from test_step_overlap import LayeredSGD

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.step.worker import THREAD_NAME, UpdateWorker

CPU = torch.device("cpu")


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


class _ThreadRecordingSGD(LayeredSGD):
    """Records the thread object of every group's update."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.update_threads: set[threading.Thread] = set()

    def step_params(self, params, *, out_bf16=None) -> None:
        self.update_threads.add(threading.current_thread())
        super().step_params(params, out_bf16=out_bf16)


def test_fifty_steps_run_on_one_update_thread_joined_at_detach(tmp_path):
    before = set(_workers())
    model = build_model("llama", 2)
    engine = attach(model, make_plan("checkpoint_all", 2), device=CPU, nvme_dir=str(tmp_path))
    opt = _ThreadRecordingSGD(model.parameters())
    ids = batches(1)[0]
    for _ in range(50):
        model(input_ids=ids, labels=ids).loss.backward()
        engine.step_layerwise(opt)
        model.zero_grad()
    engine.synchronize()
    assert len(opt.calls) == 50 * 4  # embeddings, 2 layers, output side, each step
    assert len(opt.update_threads) == 1, (
        f"50 steps ran on {len(opt.update_threads)} update threads: one expected")
    (worker,) = opt.update_threads
    assert worker in set(_workers()) - before  # alive between steps, named
    engine.detach()
    assert not worker.is_alive(), "detach left the update worker running"


class _FailingSGD(LayeredSGD):
    """Fails its first update of the first decoder layer."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.failed = False

    def step_params(self, params, *, out_bf16=None) -> None:
        if not self.failed and len(self.calls) == 1:
            self.failed = True
            self.calls.append([])
            raise ValueError("a failing update")
        super().step_params(params, out_bf16=out_bf16)


def test_an_update_error_reaches_the_training_thread_and_the_worker_goes_on(tmp_path):
    model = build_model("llama", 2)
    engine = attach(model, make_plan("checkpoint_all", 2), device=CPU, nvme_dir=str(tmp_path))
    opt = _FailingSGD(model.parameters())
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    engine.step_layerwise(opt)  # returns while the update runs, then fails in it
    with pytest.raises(RuntimeError, match="layer-wise optimizer update failed") as info:
        engine.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    engine.step_layerwise(opt)  # the same worker runs the next step
    engine.synchronize()
    assert len(opt.calls) == 2 + 4
    engine.detach()


def test_close_lets_queued_jobs_finish_and_refuses_new_ones():
    worker = UpdateWorker()
    ran: list[int] = []
    gate = threading.Event()
    worker.submit(gate.wait)
    for i in range(3):
        worker.submit(lambda i=i: ran.append(i))
    gate.set()
    worker.close()
    assert ran == [0, 1, 2] and not worker.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_an_optimizer_stepped_by_a_second_engine_defers_its_zero_grad_to_that_one(tmp_path):
    from lazytrain_accel.optim import HybridAdamW8bit

    model = build_model("llama", 2)
    opt = HybridAdamW8bit(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    for _ in range(2):  # attached, stepped, detached; then again with a new engine
        engine = attach(model, make_plan("checkpoint_all", 2), device=CPU,
                        nvme_dir=str(tmp_path))
        model(input_ids=ids, labels=ids).loss.backward()
        engine.step_layerwise(opt)
        assert opt.zero_grad_gate == engine.steps.defer_zero_grad
        opt.zero_grad()
        engine.detach()
