"""Decoding a solution into a per-window transfer schedule, and the window objective.

The MIP only guarantees (Hall's condition) that each link's activation bytes fit its
free window time; earliest-deadline-first recovers one assignment that does. Every
number comes from `Problem` (the one cost model): window durations, mandatory bytes,
rates and each boundary's window range.
"""

from __future__ import annotations

import itertools

from lazytrain_accel.planning.plan import Home, Transfer, TransferKind
from lazytrain_accel.planning.problem import LINKS, Problem

#: A solver value within this many seconds of a window's edge must not spill into the
#: last window allowed (round-off, not a decision).
ROUND_OFF_S = 1e-6


def blocks_of(homes: list[Home] | tuple[Home, ...]) -> list[tuple[int, int]]:
    kept = [i for i, h in enumerate(homes) if h != Home.RECOMPUTE]
    return list(itertools.pairwise(kept))


def block_weights(homes: list[Home] | tuple[Home, ...]) -> dict[tuple[int, int], int]:
    """The edge weights of fixed homes, as `Problem`'s cost methods take them."""
    return dict.fromkeys(blocks_of(homes), 1)


def _edf(jobs: list[tuple[int, int, int, int]], capacity_bytes: list[float],
         kind: TransferKind, *, as_late_as_possible: bool = False) -> list[Transfer]:
    """jobs: (boundary, bytes, first window, last window). Earliest deadline first, or,
    for reloads, the same run backwards in time (latest release first), so a reloaded
    boundary reaches the device as late as the links allow. A job still unfinished at the
    end of its window set gets the rest there (only solver round-off gets that far)."""
    remaining = {b: n for b, n, _, _ in jobs}
    last_window = {b: lo if as_late_as_possible else hi for b, _, lo, hi in jobs}
    out = []
    windows = range(len(capacity_bytes))
    for w in reversed(windows) if as_late_as_possible else windows:
        ready = sorted((-hi if as_late_as_possible else hi, lo, b) for b, _, lo, hi in jobs
                       if lo <= w <= hi and remaining[b] > 0)
        free = max(capacity_bytes[w], 0.0)
        for _, _, b in ready:
            nbytes = remaining[b] if last_window[b] == w else min(remaining[b], int(free))
            if nbytes <= 0:
                continue
            out.append(Transfer(boundary=b, kind=kind, window=w, bytes=nbytes))
            remaining[b] -= nbytes
            free -= nbytes
    return out


def schedule_transfers(p: Problem, homes: list[Home] | tuple[Home, ...],
                       exposed_s: list[float] | tuple[float, ...]) -> list[Transfer]:
    """Per-window transfers of activation bytes, given the solver's exposure per window."""
    edges = block_weights(homes)
    duration_s = p.window_durations_s(edges)
    mandatory = p.mandatory_bytes(edges)
    A = p.boundary_bytes

    def capacity(link: str) -> list[float]:
        return [p.rate_bytes_per_s(link) * (duration_s[w] + exposed_s[w] + ROUND_OFF_S)
                - mandatory[link][w] for w in range(p.num_windows)]

    def jobs(link: str) -> list[tuple[int, int, int, int]]:
        return [(i, A, *p.transfer_windows(link, i, h)) for i, h in enumerate(homes)
                if p.moves_on(link, h)]

    d2h = _edf(jobs("d2h"), capacity("d2h"), TransferKind.D2H)
    h2d = _edf(jobs("h2d"), capacity("h2d"), TransferKind.H2D, as_late_as_possible=True)
    writes = _edf(jobs("nvme_write"), capacity("nvme_write"), TransferKind.NVME_WRITE)
    reads = _edf(jobs("nvme_read"), capacity("nvme_read"), TransferKind.NVME_READ,
                 as_late_as_possible=True)
    out: list[Transfer] = []
    for moves, late in ((d2h, False), (writes, False), (reads, True), (h2d, True)):
        # Within a window, the boundary needed first goes first.
        out += sorted(moves, key=lambda t: (t.window, -t.boundary if late else t.boundary))
    return out


def window_objective_s(p: Problem, homes: list[Home] | tuple[Home, ...],
                       transfers: list[Transfer]) -> float:
    """The MIP's objective (without tie-breakers) at fixed homes and transfers: block
    costs, plus per window the excess of its slowest link over its compute."""
    edges = block_weights(homes)
    duration_s = p.window_durations_s(edges)
    traffic = {k: [float(b) for b in v] for k, v in p.mandatory_bytes(edges).items()}
    for t in transfers:
        traffic[t.kind.value][t.window] += t.bytes
    # on a GPU, a window whose host work outlasts its compute waits for the host
    host_s = ([0.0] * p.num_windows if p.host_on_compute
              else [h - d for h, d in zip(p.host_window_s(edges), duration_s, strict=True)])
    exposed = sum(max([0.0, host_s[w]] + [traffic[k][w] / p.rate_bytes_per_s(k) - duration_s[w]
                                          for k in LINKS]) for w in range(p.num_windows))
    return sum(p.block_cost_s(s, e) for s, e in edges) + exposed
