"""The emulated async device: copies land late, on a worker; a missing wait fails loudly."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lazytrain_accel.engine.device import emulation
from lazytrain_accel.engine.device.backends import make_streams
from lazytrain_accel.engine.device.emulation import (
    INT_SENTINEL,
    BufferReuseError,
    EmulatedStreams,
    EmulationSettings,
)
from lazytrain_accel.engine.device.streams import CudaStreams, SyncStreams

CPU = torch.device("cpu")


def _slow(seed: int = 0, **rates: float) -> EmulatedStreams:
    return EmulatedStreams(CPU, EmulationSettings(seed=seed, link_bytes_per_s=rates))


def test_a_destination_is_poisoned_until_its_event_completes():
    streams = _slow(h2d=40_000.0)  # 4 KB take 0.1 s
    src, dst = torch.ones(1024), torch.zeros(1024)
    ints, int_dst = torch.arange(8), torch.zeros(8, dtype=torch.int64)
    with streams.copy_stream("h2d"):
        streams.copy_(torch.empty(1024), src)  # 0.1 s ahead of the copies checked below
        streams.copy_(dst, src)
        streams.copy_(int_dst, ints)
        event = streams.record()
    assert not event.query()
    assert torch.isnan(dst).all() and (int_dst == INT_SENTINEL).all()  # read before the wait
    streams.host_waits(event)
    assert event.query() and torch.equal(dst, src) and torch.equal(int_dst, ints)
    streams.close()


def test_a_copy_does_not_bump_the_version_a_second_time_later():
    streams = _slow(d2h=1e6)
    dst = torch.zeros(256)
    with streams.copy_stream("d2h"):
        streams.copy_(dst, torch.ones(256))
        version = dst._version  # the engine records this right after issuing
        event = streams.record()
    streams.host_waits(event)
    assert dst._version == version


def test_a_timed_run_leaves_destinations_unpoisoned_and_bumps_each_version_once():
    """`poison_copies=False` (bench/fidelity.py: the fill is host work a GPU's copy does
    not cost): a destination keeps its bytes until the copy lands, and its version still
    moves once, at issue, as the engine's checks expect; an NVMe read's target too."""
    streams = EmulatedStreams(CPU, EmulationSettings(
        seed=0, link_bytes_per_s={"h2d": 40_000.0}, poison_copies=False))
    src, dst = torch.ones(1024), torch.zeros(1024)
    before = dst._version
    with streams.copy_stream("h2d"):
        streams.copy_(torch.empty(1024), src)  # 0.1 s ahead of the copy checked below
        streams.copy_(dst, src)
        version = dst._version
        event = streams.record()
    assert not event.query()
    assert version == before + 1 and (dst == 0).all()  # unfilled before the wait
    target = torch.zeros(16)
    streams.poison(target)
    assert (target == 0).all()
    streams.host_waits(event)
    assert torch.equal(dst, src) and dst._version == version
    streams.close()


def test_throttled_links_take_bytes_over_rate():
    """(What the host waits on them is the engine's `stall_s`: test_backend_clock.py.)"""
    streams = _slow(h2d=1e6)
    start = time.perf_counter()
    with streams.copy_stream("h2d"):
        streams.copy_(torch.empty(25_000), torch.ones(25_000))  # 100 KB at 1 MB/s
        event = streams.record()
    streams.host_waits(event)
    assert time.perf_counter() - start >= 0.1


def test_io_threads_share_a_throttled_drives_clock():
    """Two I/O threads (the host state's) on one throttled link take the bytes of both over
    the rate, as one drive serving them in turn, not each its own drive."""
    streams = _slow(nvme_read=1e6)

    def transfer() -> None:
        with streams.io_link("nvme_read", 50_000):  # 50 KB at 1 MB/s
            pass

    start = time.perf_counter()
    threads = [threading.Thread(target=transfer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - start >= 0.1


def test_copies_queued_back_to_back_stream_at_the_link_rate_however_late_the_worker_wakes(
        monkeypatch):
    """Each queued copy's pieces are due when the copy before it was due to end: the
    worker's late wake-ups (2 ms planted after every sleep, as a GIL hand-off from a busy
    host thread costs) are not charged to the link. Before, each copy's clock restarted
    when the worker reached it, so every op added its wake-up to the link's time."""
    sleep_until = emulation._sleep_until
    due: list[float] = []

    def late(deadline_s: float) -> None:
        due.append(deadline_s)
        sleep_until(deadline_s)
        time.sleep(0.002)

    monkeypatch.setattr(emulation, "_sleep_until", late)
    rate, numel, copies = 4e6, 1000, 10  # 4 KB at 4 MB/s: 1 ms each
    streams = EmulatedStreams(CPU, EmulationSettings(jitter_s=0.0,
                                                     link_bytes_per_s={"h2d": rate}))
    release = threading.Event()
    with streams.copy_stream("h2d"):  # all queued before the worker reaches the first
        streams._current().submit(lambda _start_s: release.wait() and None, jitter=False)
        for _ in range(copies):
            streams.copy_(torch.empty(numel), torch.ones(numel))
        event = streams.record()
    release.set()
    streams.host_waits(event)
    streams.close()
    pieces = emulation.THROTTLED_PIECES
    assert len(due) == copies * pieces
    copy_s = numel * 4 / rate
    first = due[pieces - 1] - copy_s  # when the first copy began
    ends = [due[k * pieces + pieces - 1] - first for k in range(copies)]
    assert ends == pytest.approx([(k + 1) * copy_s for k in range(copies)], abs=1e-9)


def test_side_streams_order_by_events_not_by_luck():
    streams = _slow(h2d=20_000.0)  # the H2D copy takes 0.2 s; D2H is unthrottled
    a, b, c = torch.ones(1000), torch.empty(1000), torch.empty(1000)
    with streams.copy_stream("h2d"):
        streams.copy_(b, a)
        loaded = streams.record()
    with streams.copy_stream("d2h"):
        streams.compute_waits(loaded)  # the D2H stream waits for the H2D copy
        streams.copy_(c, b)
        done = streams.record()
    streams.host_waits(done)
    assert torch.equal(c, a)


def test_reusing_a_staging_buffer_before_waiting_raises_and_names_the_seed():
    streams = _slow(seed=41, h2d=1e5)
    staging, slot = torch.empty(1000), torch.empty(1000)
    with streams.copy_stream("h2d"):
        streams.copy_(slot, staging)
        event = streams.record()
    with pytest.raises(BufferReuseError, match="LAZYTRAIN_EMULATE_SEED=41"):
        streams.claim(staging)
    streams.host_waits(event)
    streams.claim(staging)  # fine once the copy that read it was waited for


def test_worker_errors_surface_on_the_host_with_the_seed():
    streams = _slow(seed=9)
    with streams.copy_stream("d2h"):
        streams.copy_(torch.empty(3), torch.ones(3))
        streams._workers["d2h"].submit(lambda _start_s: 1 / 0)
        event = streams.record()
    with pytest.raises(RuntimeError, match="LAZYTRAIN_EMULATE_SEED=9") as info:
        streams.host_waits(event)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_close_runs_the_queued_copies_and_ends_the_worker_threads():
    streams = _slow(h2d=40_000.0)  # 4 KB take 0.1 s
    src, dst = torch.ones(1024), torch.empty(1024)
    with streams.copy_stream("h2d"):
        streams.copy_(dst, src)
    threads = [worker._thread for worker in streams._workers.values()]
    streams.close()
    assert torch.equal(dst, src) and not any(thread.is_alive() for thread in threads)


def test_a_worker_stuck_past_the_stop_timeout_is_left_behind_with_a_warning(monkeypatch,
                                                                             caplog):
    monkeypatch.setattr(emulation, "STOP_TIMEOUT_S", 0.05)
    streams, gate = _slow(), threading.Event()
    # an op waiting for what never comes
    streams._workers["h2d"].submit(lambda _start_s: gate.wait() and None)
    with caplog.at_level("WARNING"):
        streams.close()
    gate.set()
    assert "emulated h2d stream still runs" in caplog.text


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("LAZYTRAIN_EMULATE_ASYNC", raising=False)
    assert isinstance(make_streams(CPU), SyncStreams)
    monkeypatch.setenv("LAZYTRAIN_EMULATE_ASYNC", "1")
    monkeypatch.setenv("LAZYTRAIN_EMULATE_SEED", "5")
    streams = make_streams(CPU)
    assert isinstance(streams, EmulatedStreams) and streams.seed == 5
    assert streams.is_async and streams.settings.link_bytes_per_s == {}
    assert isinstance(make_streams(CPU, emulation=False), SyncStreams)
    assert not isinstance(make_streams(CPU, emulation=False), CudaStreams)
