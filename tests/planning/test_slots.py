"""The device weight slots' policy the engine's pool and the simulator share."""

from __future__ import annotations

import pytest

from lazytrain_accel.planning.slots import WeightSlots


def _load(slots: WeightSlots, layer: int, *, busy: tuple[int, ...] = ()) -> int:
    slot = slots.pick(busy=busy, for_prefetch=False)
    assert slot is not None
    slots.filled(slot, layer)
    return slot


def test_a_load_takes_the_least_recently_used_slot_whose_layer_ran() -> None:
    slots = WeightSlots(2)
    a = _load(slots, 1)
    slots.ran(1)
    b = _load(slots, 2, busy=(a,))
    assert b != a
    slots.ran(2)
    assert _load(slots, 3, busy=(b,)) == a  # layer 1 ran, and longest ago


def test_a_prefetch_never_evicts_a_layer_still_to_run() -> None:
    slots = WeightSlots(2)
    _load(slots, 1)
    _load(slots, 2)
    assert slots.pick(busy=(), for_prefetch=True) is None  # both loaded, neither ran
    slots.ran(1)
    assert slots.pick(busy=(), for_prefetch=True) == slots.slot_of(1)
    assert slots.keep(1) == slots.slot_of(1)  # asked for again: kept until it runs
    assert slots.pick(busy=(), for_prefetch=True) is None


def test_forget_and_invalidate() -> None:
    slots = WeightSlots(3)
    for layer in (1, 2, 3):
        _load(slots, layer)
    slots.forget_all_but(3)
    assert slots.layers.count(None) == 2 and slots.slot_of(3) is not None
    slots.invalidate()
    assert slots.layers == [None] * 3
    with pytest.raises(AssertionError, match="no weight slot holds it"):
        slots.ran(3)
