"""Step terms are timed by the stream backend's clock (CUDA events on a GPU), and the stats
and plan fidelity read that clock, not the host's."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from engine_helpers import batches, build_model, make_plan

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.core import engine as engine_module
from lazytrain_accel.engine.device.emulation import EmulatedStreams, EmulationSettings
from lazytrain_accel.engine.device.streams import SyncStreams
from lazytrain_accel.engine.stats import Accounting, ElapsedInterval
from lazytrain_accel.engine.step.fidelity import FidelityMonitor

CPU = torch.device("cpu")
#: What the fake backend's clock says every timed region took: far above the host time
#: of the tiny model's work, so a figure from the host clock cannot pass for it.
TICK_S = 0.5


class TickingStreams(SyncStreams):
    """The synchronous CPU backend with a clock of its own: each interval is TICK_S."""

    def start_interval(self):
        return lambda: ElapsedInterval(TICK_S)


def test_stats_and_fidelity_read_the_backends_clock(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(engine_module, "make_streams", lambda device, emulation: TickingStreams(
        device))
    model = build_model("qwen2", 10)
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path))
    ids = next(iter(batches(1)))
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    step_s = time.perf_counter() - start
    stats = engine.stats()

    runs = stats.layer_forwards + stats.layer_backwards
    assert runs >= 8 and stats.compute_s == pytest.approx(TICK_S * runs)
    assert stats.recompute_s == pytest.approx(TICK_S * stats.layer_recomputes)
    assert stats.compute_s > 2 * step_s  # not the host's clock
    for kind in ("weights_h2d", "grads_d2h"):
        ticks = stats.transfer_s[kind] / TICK_S
        assert stats.transfer_bytes[kind] > 0 and ticks >= 1 and ticks == pytest.approx(
            round(ticks))

    # fidelity splits the step with the same figures: a compute term of the clock's ticks
    prediction = engine.plan.prediction
    monitor = FidelityMonitor(tolerance=1e-3, patience=1)
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        monitor.add_step(prediction, step_s=stats.compute_s + stats.recompute_s + 1.0,
                         stats=stats, report=lines.append)
    measured_compute_s = stats.compute_s + stats.recompute_s
    assert len(lines) == 1
    assert f"compute_s term drifted most (predicted {prediction.compute_s + prediction.recompute_s:.3f} s, measured {measured_compute_s:.3f} s)" in caplog.text  # noqa: E501
    engine.detach()


def test_emulated_links_are_timed_on_their_worker_not_at_issue():
    """On the emulated device a copy runs later on the side stream's worker: its interval
    is what the worker spent on it (here a throttled 0.2 s), not the instant of issue."""
    rate_bytes_per_s = 4e6
    streams = EmulatedStreams(CPU, EmulationSettings(seed=0, jitter_s=0.0,
                                                     link_bytes_per_s={"h2d": rate_bytes_per_s}))
    acct = Accounting(clock=streams)
    src, dst = torch.ones(200_000), torch.empty(200_000)  # 0.8 MB: 0.2 s at the rate
    issued = time.perf_counter()
    with streams.copy_stream("h2d"), acct.timed_transfer("h2d", 800_000):
        streams.copy_(dst, src)
        event = streams.record()
    issue_s = time.perf_counter() - issued
    streams.host_waits(event)
    stats = acct.snapshot()
    assert issue_s < 0.1 < 0.19 < stats.transfer_s["h2d"] < 1.0
    assert stats.transfer_bytes["h2d"] == 800_000 and torch.equal(dst, src)
    streams.close()


def test_a_pending_interval_is_added_once_it_completes():
    """`snapshot()` waits for intervals still running, and adds each exactly once, also
    when the work completes on another thread meanwhile."""
    done = threading.Event()

    class Pending:
        def query(self) -> bool:
            return done.is_set()

        def seconds(self) -> float:
            done.wait()
            return 0.25

    class PendingClock:
        def start_interval(self):
            return Pending

    acct = Accounting(clock=PendingClock())
    with acct.timed("compute_s"):
        pass
    with acct.timed("compute_s"):
        pass
    threading.Timer(0.05, done.set).start()
    assert acct.snapshot().compute_s == pytest.approx(0.5)
    assert acct.snapshot().compute_s == pytest.approx(0.5)


def test_stall_is_the_time_the_emulated_compute_waits_for_its_links(tmp_path):
    """On the emulated device compute is the host thread, so a weight load still on the
    throttled H2D link blocks it: `stall_s` holds those waits (it read ~0 when only the
    engine's explicit host waits were counted, 5 ms of a measured 770 ms in the fidelity
    bench), and never more than the step's wall time."""
    model = build_model("llama", 10)
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path),
                    emulation=EmulationSettings(seed=0, jitter_s=0.0,
                                                link_bytes_per_s={"h2d": 5e5}))
    ids = next(iter(batches(1)))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    engine.reset_stats()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    step_s = time.perf_counter() - start
    stats = engine.stats()
    link_s = stats.transfer_s["weights_h2d"]
    # the throttled loads dwarf the tiny model's compute: most of the link's time is waited
    assert link_s > 5 * stats.compute_s, (link_s, stats.compute_s)
    assert 0.5 * (link_s - stats.compute_s) < stats.stall_s <= step_s, (stats, step_s)
    engine.detach()
