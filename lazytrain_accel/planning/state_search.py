"""Which layers' host state lives on NVMe (`StateHomes`), when the DRAM budget cannot hold
all of it: the candidates `make_plan` solves and simulates, the fastest kept.

Each candidate homes the fewest (part, layer) pairs that let the static host bytes fit
the DRAM budget, in one order: `greedy` (whole layers in DRAM in forward order, the
rest on NVMe), `backward_first` (copies and gradients first: half their traffic runs in
the backward), `optimizer_first` (masters and moments first), each also with room left
for every boundary in DRAM; and `all_nvme` (ZeRO-Infinity's placement).
Docs: docs/planner.md "Host state on NVMe".
"""

from __future__ import annotations

from lazytrain_accel.planning.plan import STATE_PARTS, StateHomes
from lazytrain_accel.planning.problem import Problem, with_state_homes
from lazytrain_accel.planning.state import allowed_layers

#: Orders of (part, layer) in which each candidate moves state to NVMe, by name.
STATE_ORDERS: tuple[str, ...] = ("greedy", "backward_first", "optimizer_first")
#: A candidate's name suffix when it leaves room for every boundary in DRAM.
ROOM_SUFFIX = "+dram_boundaries"
#: Every candidate's name (`PlanRequest.host_state` takes one).
CANDIDATE_NAMES: tuple[str, ...] = (*(order + room for order in STATE_ORDERS
                                      for room in ("", ROOM_SUFFIX)), "all_nvme")


def needs_state_homes(p: Problem) -> bool:
    """Whether the host state, all in DRAM, leaves no room in the DRAM budget."""
    return p.cpu_fixed_bytes > p.budgets.cpu_bytes


def _moves(p: Problem, order: str, recomputed: tuple[int, ...]) -> list[tuple[str, int]]:
    """(part, layer) in the order `order` moves them to NVMe."""
    L = p.num_layers
    allowed = {part: set(allowed_layers(part, L, folds=p.fold_s > 0,
                                        copies_bytes=p.state_sizes.copies_bytes))
               if part in p.state_parts else set() for part in STATE_PARTS}
    allowed["copies"] -= set(recomputed)
    if order == "greedy":  # the last layers' whole state first: DRAM keeps layers 1..k
        pairs = [(part, j) for j in range(L, 0, -1) for part in STATE_PARTS]
    elif order == "backward_first":
        pairs = [(part, j) for part in ("copies", "grads", "optimizer")
                 for j in range(L, 0, -1)]
    elif order == "optimizer_first":
        pairs = [(part, j) for part in ("optimizer", "grads", "copies")
                 for j in range(L, 0, -1)]
    else:
        raise ValueError(f"state order {order!r} is not one of {STATE_ORDERS}")
    return [(part, j) for part, j in pairs if j in allowed[part]]


def _homes(moved: list[tuple[str, int]]) -> StateHomes:
    return StateHomes(**{part: tuple(sorted(j for q, j in moved if q == part))
                         for part in STATE_PARTS})


def _fewest(p: Problem, moves: list[tuple[str, int]], room_bytes: int) -> StateHomes | None:
    """The shortest prefix of `moves` whose static host bytes leave `room_bytes` in the
    DRAM budget (a bisection: each move frees DRAM), None when even all of them do not."""
    def fits(k: int) -> bool:
        q = with_state_homes(p, _homes(moves[:k]))
        return q.cpu_fixed_bytes + room_bytes <= q.budgets.cpu_bytes

    if not moves or not fits(len(moves)):
        return None
    lo, hi = 1, len(moves)  # the staging buffers make k = 0 never the answer here
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return _homes(moves[:lo])


def state_candidates(p: Problem, *, recomputed: tuple[int, ...] = ()
                     ) -> list[tuple[str, StateHomes]]:
    """The state homes `make_plan` tries for `p` (whose host state does not fit DRAM),
    distinct, fewest NVMe bytes first, `all_nvme` last even where it does not fit either
    (its refusal names what is still short). `recomputed`: layers a fixed strategy
    re-runs, whose compute copies stay in DRAM."""
    found: dict[StateHomes, str] = {}
    every = _homes(_moves(p, "optimizer_first", recomputed))
    for order in STATE_ORDERS:
        moves = _moves(p, order, recomputed)
        for room_name, room_bytes in (("", 0), (ROOM_SUFFIX,
                                                (p.num_layers - 1) * p.boundary_bytes)):
            homes = _fewest(p, moves, room_bytes)
            if homes is not None and homes != every:
                found.setdefault(homes, order + room_name)
    ranked = sorted(((name, homes) for homes, name in found.items()),
                    key=lambda c: with_state_homes(p, c[1]).nvme_state_bytes)
    return [*ranked, ("all_nvme", every)]
