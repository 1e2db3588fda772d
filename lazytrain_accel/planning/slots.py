"""Device weight slots: how many there are and which layer a load puts where.

The one policy of the engine's `WeightPool` (`engine/memory/weights.py`, which holds the tensors
and events) and the simulator (`simulate.py`, which holds the load ops): bookkeeping only,
no torch. A load goes to the least recently used slot not busy, preferring one whose layer
ran since it was loaded: a layer loaded (or asked for again while loaded) and not run since
is kept, and a prefetch only ever takes a slot whose layer has run.
"""

from __future__ import annotations

from collections.abc import Collection

from lazytrain_accel.planning.plan import Plan
from lazytrain_accel.planning.problem import weight_buffer_count


def weight_slots(plan: Plan) -> int:
    """Device weight slots for `plan`: 3 when it re-runs layers, else 2 (what
    `problem.build_problem` charges for them)."""
    return weight_buffer_count(max(e - s for s, e in plan.blocks))


class WeightSlots:
    """Which layer each slot holds, and which slot the next load takes."""

    def __init__(self, count: int) -> None:
        self.layers: list[int | None] = []  # the layer each slot holds (1-based), or None
        self._kept: list[bool] = []  # loaded or asked for again, not run since: keep it
        self._used: list[int] = []  # clock of the slot's last load or run
        self._clock = 0
        self.grow(count)

    @property
    def count(self) -> int:
        return len(self.layers)

    def grow(self, count: int) -> None:
        """Have at least `count` slots (a new plan may recompute)."""
        while len(self.layers) < count:
            self.layers.append(None)
            self._kept.append(False)
            self._used.append(0)

    def slot_of(self, layer: int) -> int | None:
        return self.layers.index(layer) if layer in self.layers else None

    def keep(self, layer: int) -> int | None:
        """A prefetch of `layer`: if a slot holds it, keep it until it runs (its slot)."""
        slot = self.slot_of(layer)
        if slot is not None:
            self._kept[slot] = True
        return slot

    def pick(self, *, busy: Collection[int], for_prefetch: bool) -> int | None:
        """The slot a load of a layer not held takes, else None: none is free of `busy`
        (slots whose layer is running), or, for a prefetch, none has run since its load."""
        free = [s for s in range(self.count) if s not in busy]
        spent = [s for s in free if not self._kept[s]]
        if spent or for_prefetch:
            free = spent
        return min(free, key=lambda s: self._used[s]) if free else None

    def filled(self, slot: int, layer: int) -> None:
        """`layer` was loaded into `slot` (kept until it runs)."""
        self.layers[slot], self._kept[slot] = layer, True
        self._tick(slot)

    def ran(self, layer: int) -> int:
        """`layer` runs on its slot (returned): the slot may be reused once it is done."""
        slot = self.slot_of(layer)
        if slot is None:
            raise AssertionError(f"layer {layer} runs but no weight slot holds it (evicted "
                                 "before use): a schedule bug")
        self._kept[slot] = False
        self._tick(slot)
        return slot

    def forget_all_but(self, layer: int) -> None:
        """At the last forward layer: the backward loads its layers anew, in its own order
        (as the planner counts them), so only `layer`, running now, stays."""
        for slot, held in enumerate(self.layers):
            if held != layer:
                self.layers[slot], self._kept[slot] = None, False

    def forget(self, layer: int) -> None:
        """Drop `layer` from the slot holding it, if any (what the slot holds is stale)."""
        slot = self.slot_of(layer)
        if slot is not None:
            self.layers[slot], self._kept[slot] = None, False

    def invalidate(self) -> None:
        """Forget every loaded layer (the masters may have been updated)."""
        self.layers = [None] * self.count
        self._kept = [False] * self.count

    def _tick(self, slot: int) -> None:
        self._clock += 1
        self._used[slot] = self._clock
