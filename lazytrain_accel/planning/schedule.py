"""Decoding a solution into a per-window transfer schedule and predicting its step.

The MIP only guarantees (Hall's condition) that each link's activation bytes fit its
free window time; earliest-deadline-first recovers one assignment that does. The
prediction is then recomputed from that schedule, so it describes exactly the transfers
the engine will issue, whatever the MIP's rounding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from lazytrain_accel.planning.plan import Home, Prediction, Transfer, TransferKind
from lazytrain_accel.planning.problem import Problem

LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")
_KIND_LINK = {TransferKind.H2D: "h2d", TransferKind.D2H: "d2h",
              TransferKind.NVME_READ: "nvme_read", TransferKind.NVME_WRITE: "nvme_write"}


def blocks_of(homes: list[Home]) -> list[tuple[int, int]]:
    kept = [i for i, h in enumerate(homes) if h != Home.RECOMPUTE]
    return list(itertools.pairwise(kept))


@dataclass(kw_only=True)
class WindowLoads:
    """Per window: compute seconds and mandatory bytes per link, for fixed homes."""

    duration_s: list[float]
    mandatory_bytes: dict[str, list[int]]
    recompute_s: float
    restream_stall_s: float  # recompute waiting for re-streamed weights (H2D exposure)


def window_loads(p: Problem, homes: list[Home]) -> WindowLoads:
    W, L = p.num_windows, p.num_layers
    dur = [p.base_duration_s(w) for w in range(W)]
    h2d = [p.weight_h2d_bytes(w) for w in range(W)]
    recompute_s = stall_s = 0.0
    for s, e in blocks_of(homes):
        if e - s >= 2:
            dur[2 * L - e] += p.recompute_s(s, e) + p.restream_stall_s(s, e)
            recompute_s += p.recompute_s(s, e)
            stall_s += p.restream_stall_s(s, e)
            for w, nbytes in p.restream_windows(s, e):
                h2d[w] += nbytes
    mandatory = {"h2d": h2d, "d2h": [p.grad_d2h_bytes(w) for w in range(W)],
                 "nvme_read": [0] * W, "nvme_write": [0] * W}
    return WindowLoads(duration_s=dur, mandatory_bytes=mandatory, recompute_s=recompute_s,
                       restream_stall_s=stall_s)


def _edf(jobs: list[tuple[int, int, int, int]], capacity_bytes: list[float],
         kind: TransferKind, *, as_late_as_possible: bool = False) -> list[Transfer]:
    """jobs: (boundary, bytes, first window, last window). Earliest deadline first, or,
    for reloads, the same run backwards in time (latest release first), so a reloaded
    boundary reaches the device as late as the links allow. A job still unfinished at the
    end of its window set gets the rest there (only solver round-off gets that far)."""
    remaining = {b: n for b, n, _, _ in jobs}
    out = []
    windows = range(len(capacity_bytes))
    for w in reversed(windows) if as_late_as_possible else windows:
        if as_late_as_possible:
            ready = sorted((-hi, lo, b) for b, _, lo, hi in jobs
                           if lo <= w <= hi and remaining[b] > 0)
        else:
            ready = sorted((hi, lo, b) for b, _, lo, hi in jobs
                           if lo <= w <= hi and remaining[b] > 0)
        free = max(capacity_bytes[w], 0.0)
        for _, lo, b in ready:
            last = lo if as_late_as_possible else next(j[3] for j in jobs if j[0] == b)
            nbytes = remaining[b] if last == w else min(remaining[b], int(free))
            if nbytes <= 0:
                continue
            out.append(Transfer(boundary=b, kind=kind, window=w, bytes=nbytes))
            remaining[b] -= nbytes
            free -= nbytes
    return out


def schedule_transfers(p: Problem, homes: list[Home], exposed_s: list[float]) -> list[Transfer]:
    """Per-window transfers of activation bytes, given the solver's exposure per window."""
    loads = window_loads(p, homes)
    rates = {"h2d": p.h2d_bytes_per_s, "d2h": p.d2h_bytes_per_s,
             "nvme_read": p.nvme_read_bytes_per_s, "nvme_write": p.nvme_write_bytes_per_s}
    A = p.boundary_bytes
    offloaded = [i for i, h in enumerate(homes) if h in (Home.CPU, Home.NVME)]
    on_nvme = [i for i, h in enumerate(homes) if h == Home.NVME]

    def capacity(link: str) -> list[float]:
        # Round-off slack: a solver value within 1e-6 s of the edge must not spill.
        return [rates[link] * (loads.duration_s[w] + exposed_s[w] + 1e-6)
                - loads.mandatory_bytes[link][w] for w in range(p.num_windows)]

    d2h = _edf([(i, A, *p.d2h_windows(i)) for i in offloaded], capacity("d2h"),
               TransferKind.D2H)
    h2d = _edf([(i, A, *p.h2d_windows(i)) for i in offloaded], capacity("h2d"),
               TransferKind.H2D, as_late_as_possible=True)
    # An NVMe write starts in the window after its D2H ends, a read ends in the window
    # before its H2D starts; where that leaves no window, in the same one (back to back).
    write_jobs, read_jobs = [], []
    for i in on_nvme:
        (w_lo, w_hi), (r_lo, r_hi) = p.nvme_write_windows(i), p.nvme_read_windows(i)
        last_d2h = max(t.window for t in d2h if t.boundary == i)
        first_h2d = min(t.window for t in h2d if t.boundary == i)
        write_jobs.append((i, A, min(max(w_lo, last_d2h + 1), w_hi), w_hi))
        read_jobs.append((i, A, r_lo, max(min(r_hi, first_h2d - 1), r_lo)))
    writes = _edf(write_jobs, capacity("nvme_write"), TransferKind.NVME_WRITE)
    reads = _edf(read_jobs, capacity("nvme_read"), TransferKind.NVME_READ,
                 as_late_as_possible=True)
    out: list[Transfer] = []
    for moves, late in ((d2h, False), (writes, False), (reads, True), (h2d, True)):
        # Within a window, the boundary needed first goes first.
        out += sorted(moves, key=lambda t: (t.window, -t.boundary if late else t.boundary))
    return out


def predict(p: Problem, homes: list[Home], transfers: list[Transfer]) -> Prediction:
    """Step seconds and peaks of a plan under the window model (docs/planner.md)."""
    loads = window_loads(p, homes)
    W = p.num_windows
    rates = {"h2d": p.h2d_bytes_per_s, "d2h": p.d2h_bytes_per_s,
             "nvme_read": p.nvme_read_bytes_per_s, "nvme_write": p.nvme_write_bytes_per_s}
    traffic = {link: [float(b) for b in loads.mandatory_bytes[link]] for link in LINKS}
    for t in transfers:
        traffic[_KIND_LINK[t.kind]][t.window] += t.bytes
    by_link = {link: 0.0 for link in LINKS}
    by_link["h2d"] += p.prologue_s
    by_link["d2h"] += p.tail_s
    by_link["h2d"] += loads.restream_stall_s
    for w in range(W):
        busy = {link: traffic[link][w] / rates[link] for link in LINKS}
        link = max(busy, key=busy.get)
        by_link[link] += max(busy[link] - loads.duration_s[w], 0.0)
    exposed = sum(by_link.values())
    step = p.compute_s + loads.recompute_s + exposed
    counts = {h: sum(1 for x in homes if x == h) for h in Home}
    longest = max(e - s for s, e in blocks_of(homes))
    A = p.boundary_bytes
    return Prediction(
        step_s=step, compute_s=p.compute_s, recompute_s=loads.recompute_s, exposed_s=exposed,
        exposed_by_link_s=by_link,
        peak_gpu_bytes=p.gpu_fixed_bytes - p.gpu_reserve_bytes
        + A * (counts[Home.GPU] + longest - 1),
        peak_cpu_bytes=p.static_cpu_bytes + A * counts[Home.CPU],
        peak_nvme_bytes=A * counts[Home.NVME],
        tokens_per_s=p.tokens_per_step / step,
        tflops=6.0 * p.param_count * p.tokens_per_step / step / 1e12,
    )
