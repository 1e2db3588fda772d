"""Page-locking the node store in chunks; a failure trains unpinned, on pageable rates."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest

from lazytrain_accel.engine.device import pinning
from lazytrain_accel.engine.device.streams import CudaStreams
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, PAGEABLE_SHARE
from lazytrain_accel.run import state as run_state

GIB = 1 << 30
BASE = 0x7F00_0000_0000  # a fake address: the fakes never touch memory


class FakeCudart:
    """`torch.cuda.cudart()` whose registration fails above `limit_bytes` (or always)."""

    def __init__(self, *, limit_bytes: float) -> None:
        self.limit_bytes = limit_bytes
        self.registered: dict[int, int] = {}  # address -> bytes
        self.calls = 0

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls += 1
        assert flags == 1  # portable
        if nbytes > self.limit_bytes:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        del self.registered[address]
        return 0


class FakeBuffer:
    """What `register_pinned` reads of the store's byte tensor."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def data_ptr(self) -> int:
        return BASE

    def numel(self) -> int:
        return self._nbytes

    def element_size(self) -> int:
        return 1


def _register(monkeypatch: pytest.MonkeyPatch, cudart: FakeCudart, nbytes: int, *,
              max_chunk_bytes: int = 256 * GIB) -> bool:
    monkeypatch.setattr("torch.cuda.cudart", lambda: cudart)
    return CudaStreams.register_pinned(SimpleNamespace(), FakeBuffer(nbytes),
                                       max_chunk_bytes=max_chunk_bytes)


def test_a_registrar_failing_above_1_gib_gets_chunks(monkeypatch, caplog) -> None:
    cudart = FakeCudart(limit_bytes=GIB)
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        assert _register(monkeypatch, cudart, 5 * GIB + 123)
    assert not caplog.records
    chunks = sorted(cudart.registered.items())
    assert max(size for _, size in chunks) <= GIB
    # contiguous and whole: every byte registered once
    assert [a for a, _ in chunks] == [BASE + sum(s for _, s in chunks[:i])
                                      for i in range(len(chunks))]
    assert sum(s for _, s in chunks) == 5 * GIB + 123


def test_chunks_stay_below_the_setting() -> None:
    sizes: list[int] = []
    assert pinning.register_in_chunks(
        BASE, 5 * GIB, max_chunk_bytes=2 * GIB, what="x",
        register=lambda address, nbytes: sizes.append(nbytes) or 0, unregister=lambda _: 0)
    assert sizes == [2 * GIB, 2 * GIB, GIB]


def test_a_registrar_that_always_fails_leaves_it_unpinned_with_one_warning(
        monkeypatch, caplog) -> None:
    cudart = FakeCudart(limit_bytes=-1)
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        assert not _register(monkeypatch, cudart, 300 * GIB)
    assert len(caplog.records) == 1
    assert "training from pageable memory" in caplog.text and "CUDA error 2" in caplog.text
    assert cudart.calls <= 10  # halved down to 1 GiB, not to single pages


def test_a_failure_midway_unregisters_what_was_registered(monkeypatch) -> None:
    cudart = FakeCudart(limit_bytes=GIB)
    register = cudart.cudaHostRegister
    cudart.cudaHostRegister = lambda a, n, f: 2 if a >= BASE + 2 * GIB else register(a, n, f)
    assert not _register(monkeypatch, cudart, 4 * GIB)
    assert cudart.registered == {}


def test_unpinned_ranks_replan_on_the_pageable_rates(monkeypatch) -> None:
    """Any local rank unpinned: the plan is made again from the pageable copy rates and
    the engine runs it."""
    h200 = HARDWARE_PRESETS["h200"]
    planned: list = []
    new_plan = object()
    engine = SimpleNamespace(streams=SimpleNamespace(register_pinned=lambda b, **_: False),
                             plan=None, set_plan=lambda plan: planned.append(("set", plan)))
    state = SimpleNamespace(
        plugin=SimpleNamespace(pin_chunk_max_gib=256.0), engine=engine,
        store=SimpleNamespace(bytes=None), sizing="sizing",
        run=SimpleNamespace(hardware=h200), replanner=None,
        plan_for=lambda sizing, hardware: planned.append(("plan", sizing, hardware))
        or SimpleNamespace(plan=new_plan, hardware=hardware))
    state.adopt = functools.partial(run_state.RunState.adopt, state)
    monkeypatch.setattr(run_state.ranks, "least", lambda value: value)
    run_state._pin_store(state)
    (_, sizing, hardware), (_, plan) = planned
    assert sizing == "sizing" and plan is new_plan and state.run.plan is new_plan
    assert hardware.h2d_bytes_per_s == pytest.approx(PAGEABLE_SHARE * h200.h2d_bytes_per_s)
    assert hardware.h2d_bytes_per_s == h200.h2d_pageable_bytes_per_s
    assert hardware.d2h_bytes_per_s == h200.d2h_pageable_bytes_per_s
    assert "MegaTrain" in h200.source


def test_pinned_ranks_keep_their_plan(monkeypatch) -> None:
    engine = SimpleNamespace(streams=SimpleNamespace(register_pinned=lambda b, **_: True))
    state = SimpleNamespace(
        plugin=SimpleNamespace(pin_chunk_max_gib=256.0), engine=engine,
        store=SimpleNamespace(bytes=None),
        plan_for=lambda *a, **k: pytest.fail("re-planned while pinned"))
    monkeypatch.setattr(run_state.ranks, "least", lambda value: value)
    run_state._pin_store(state)


def test_a_profile_without_pageable_rates_takes_the_share() -> None:
    data = HARDWARE_PRESETS["rtx4090"].to_dict()
    del data["h2d_pageable_bytes_per_s"], data["d2h_pageable_bytes_per_s"]
    old = type(HARDWARE_PRESETS["rtx4090"]).from_dict(data)
    assert old.pageable_links().d2h_bytes_per_s == pytest.approx(PAGEABLE_SHARE * 24e9)
