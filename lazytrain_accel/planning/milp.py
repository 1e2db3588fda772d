"""The MIP (docs/planner.md holds the math and the symbol -> name table). The only module
that imports pyscipopt.

Two reformulations make it fast (DESIGN.md §3): transfers are not variables per boundary
and window; each link's window sets form a laminar family (offload: a suffix of the
forward; reload: a prefix of the backward; an NVMe boundary's PCIe hop: one window inside
them, `Problem.transfer_windows`), so Hall's condition on the sets, one row per boundary,
is exactly the feasibility of a byte-to-window assignment (decoded later by
earliest-deadline-first, `schedule.py`). And the block cache is `sum_l y_l`, with
covering rows instead of a big-M row per edge; `_add_block_counts` adds the valid rows
that let the LP count blocks against the GPU's slots, and `_add_hop_floors` the exposure
an NVMe boundary's one-window hop forces (together they close tight 64-layer chains at
the root node).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pyscipopt import Model, quicksum

from lazytrain_accel.planning.plan import Home, Solution, StateHomes
from lazytrain_accel.planning.problem import GIB, LINKS, Problem
from lazytrain_accel.planning.state import (
    STATE_STAGING_GROUPS,
    allowed_layers,
    update_io_bytes,
)

#: Tie-breakers in seconds, far below any gap we stop at: among equally fast plans prefer
#: fewer materialized boundaries, fewer transfers, and NVMe last.
TIE_MATERIALIZE_S = 1e-7
TIE_OFFLOAD_S = 1e-7
TIE_NVME_S = 1e-6


@dataclass(kw_only=True)
class _Vars:
    x: dict[tuple[int, int], object]
    gpu: dict[int, object]
    cpu: dict[int, object]
    nvme: dict[int, object]
    exposed: list[object]
    slack: dict[str, object]
    # Where the MIP decides the host state's homes (`Problem.decide_state`): per part, per
    # layer, "on NVMe"; and the seconds the next step waits for the update phase.
    state: dict[str, dict[int, object]] = field(default_factory=dict)
    update_exposed: object | None = None

    @property
    def state_weights(self) -> dict[str, dict[int, object]] | None:
        """The state's weights for `Problem`'s cost methods (None: the problem's homes)."""
        return self.state or None


def _add_variables(m: Model, p: Problem, edges: list[tuple[int, int]], allow_cpu: bool,
                   allow_nvme: bool) -> _Vars:
    L = p.num_layers
    x = {(s, e): m.addVar(f"edge_{s}_{e}", vtype="B") for s, e in edges}
    gpu = {i: m.addVar(f"home_gpu_{i}", vtype="B", lb=1 if i in (0, L) else 0)
           for i in range(L + 1)}
    cpu = {i: m.addVar(f"home_cpu_{i}", vtype="B")
           for i in range(1, L) if allow_cpu and p.can_offload(i)}
    nvme = {i: m.addVar(f"home_nvme_{i}", vtype="B")
            for i in range(1, L) if allow_nvme and p.can_offload(i, nvme=True)}
    exposed = [m.addVar(f"exposed_s_{w}", lb=0.0) for w in range(p.num_windows)]
    state = {} if not p.decide_state else {
        part: {j: m.addVar(f"state_{part}_nvme_{j}", vtype="B") for j in allowed_layers(
            part, L, folds=p.fold_s > 0, copies_bytes=p.state_sizes.copies_bytes)}
        for part in p.state_parts}
    return _Vars(x=x, gpu=gpu, cpu=cpu, nvme=nvme, exposed=exposed, slack={}, state=state)


def _home_sum(v: _Vars, i: int) -> object:
    return quicksum(d[i] for d in (v.gpu, v.cpu, v.nvme) if i in d)


def _offloaded(v: _Vars, i: int) -> object:
    return quicksum(d[i] for d in (v.cpu, v.nvme) if i in d)


def _add_path(m: Model, p: Problem, v: _Vars) -> None:
    """One path of edges from 0 to L through exactly the materialized boundaries."""
    L = p.num_layers
    for i in range(L + 1):
        into = [v.x[s, e] for (s, e) in v.x if e == i]
        out = [v.x[s, e] for (s, e) in v.x if s == i]
        m.addCons(_home_sum(v, i) <= 1, name=f"one_home_{i}")
        if i > 0:
            m.addCons(quicksum(into) == _home_sum(v, i), name=f"flow_in_{i}")
        if i < L:
            m.addCons(quicksum(out) == _home_sum(v, i), name=f"flow_out_{i}")
        # A block's start is read at B_e (recompute) and again at B_{s+1}: keep it on the
        # device for the whole block rather than reloading it twice. (`<= g_i`, not
        # `+ offloaded_i <= 1`: the LP must not start a block at a fraction of a CPU home.)
        long_out = [v.x[s, e] for (s, e) in v.x if s == i and e - s >= 2]
        if long_out and (i in v.cpu or i in v.nvme):
            m.addCons(quicksum(long_out) <= v.gpu[i], name=f"block_start_gpu_{i}")


def _add_capacity(m: Model, p: Problem, v: _Vars, elastic: bool) -> None:
    max_len = max((e - s for s, e in v.x), default=1)
    cache = []
    for length in range(2, max_len + 1):
        y = m.addVar(f"cache_len_ge_{length}", lb=0.0, ub=1.0)
        # One path edge covers each position k, so the long edges covering k sum to 0 or
        # 1: one row per k dominates one row per edge and tightens the LP relaxation.
        for k in range(p.num_layers):
            covering = [xv for (s, e), xv in v.x.items() if s <= k < e and e - s >= length]
            if covering:
                m.addCons(y >= quicksum(covering), name=f"cache_{length}_{k}")
        cache.append(y)
    if elastic:
        v.slack = {k: m.addVar(f"shortfall_gib_{k}", lb=0.0) for k in ("gpu", "cpu", "nvme")}
    _add_block_counts(m, p, v, cache)
    need = p.tier_need_bytes(gpu=quicksum(v.gpu.values()), cache=quicksum(cache),
                             cpu=quicksum(v.cpu.values()), nvme=quicksum(v.nvme.values()),
                             state=v.state_weights)
    for tier, nbytes in need.items():  # rows in GiB: byte-sized coefficients hurt the LP
        m.addCons(nbytes * (1 / GIB) <= p.budget_bytes(tier) / GIB + v.slack.get(tier, 0.0),
                  name=f"capacity_{tier}")


def _add_block_counts(m: Model, p: Problem, v: _Vars, cache: list) -> None:
    """Valid rows that let the LP count blocks against the GPU's boundary slots.

    With the longest block of length c+1 the cache takes c slots, so at most slots - c
    boundaries are GPU homes, each block of length >= 2 starts at its own GPU boundary
    other than L, and each recomputes at most c: recomputed <= c (GPU homes - 1). The
    product is linearized by the binary choice of c (`longest_block_{c}`) and the GPU
    homes split by it (`gpu_homes_at_{c}`). Without these rows the relaxation cannot see
    that a tight GPU caps the recompute, and SCIP may search for minutes (docs/planner.md
    "The MIP").

    In the elastic model the slots grow by the GPU shortfall `sigma` (in boundaries), split
    by c like the homes (`gpu_slack_at_{c}`, at most what c could use): the same rows, so
    a refusal's shortfall is found about as fast as a plan."""
    free_slots = (p.budgets.gpu_bytes - p.gpu_fixed_bytes) / p.boundary_bytes
    slots = free_slots // 1
    longest = [m.addVar(f"longest_block_{c + 1}", vtype="B") for c in range(len(cache) + 1)]
    split = [m.addVar(f"gpu_homes_at_{c + 1}", lb=0.0) for c in range(len(longest))]
    m.addCons(quicksum(longest) == 1, name="one_longest_block")
    for length, y in enumerate(cache, start=2):  # y_l = [some block has length >= l]
        m.addCons(y == quicksum(longest[length - 1:]), name=f"cache_is_longest_{length}")
    m.addCons(quicksum(split) == quicksum(v.gpu.values()), name="gpu_homes_split")
    if "gpu" in v.slack:  # the shortfall is continuous: the slots are no longer rounded
        most = p.num_layers + 1  # GPU homes
        sigma = [m.addVar(f"gpu_slack_at_{c + 1}", lb=0.0,
                          ub=max(most + c - free_slots, 0.0)) for c in range(len(longest))]
        m.addCons(quicksum(sigma) <= v.slack["gpu"] * (GIB / p.boundary_bytes),
                  name="gpu_slack_split")
        for c, (w, g, extra) in enumerate(zip(longest, split, sigma, strict=True)):
            m.addCons(extra <= max(most + c - free_slots, 0.0) * w,
                      name=f"gpu_slack_cap_{c + 1}")
            m.addCons(g <= (free_slots - c) * w + extra, name=f"gpu_homes_cap_{c + 1}")
    else:
        for c, (w, g) in enumerate(zip(longest, split, strict=True)):
            m.addCons(g <= max(slots - c, 0) * w, name=f"gpu_homes_cap_{c + 1}")
    recomputed = quicksum((e - s - 1) * xv for (s, e), xv in v.x.items())
    m.addCons(recomputed <= quicksum(c * (g - w) for c, (w, g)
                                     in enumerate(zip(longest, split, strict=True))),
              name="recompute_per_block")


def _add_links(m: Model, p: Problem, v: _Vars) -> None:
    dur = p.window_durations_s(v.x)
    mandatory = p.mandatory_bytes(v.x, state=v.state_weights)
    W = p.num_windows
    free = {  # seconds each link has for activations in each window
        link: [dur[w] + v.exposed[w] - mandatory[link][w] * (1 / p.rate_bytes_per_s(link))
               for w in range(W)] for link in LINKS}
    if not p.host_on_compute and (p.stage_s or p.fold_s):
        # On a GPU the host's work runs beside the kernels; a window whose host work is
        # longer than its compute waits for the host (the kernels are issued after it).
        host = p.host_window_s(v.x)
        for w in range(W):
            m.addCons(v.exposed[w] >= host[w] - dur[w], name=f"host_bound_{w}")
    for link in LINKS:  # the weights, gradients and NVMe-homed state each window moves
        for w in range(W):
            if link in ("h2d", "d2h") or mandatory[link][w]:
                m.addCons(free[link][w] >= 0, name=f"mandatory_{link}_{w}")
    for link in LINKS:
        moved = v.nvme if link.startswith("nvme") else {
            i: _offloaded(v, i) for i in sorted(set(v.cpu) | set(v.nvme))}
        movers = sorted(moved)
        demand_s = p.boundary_bytes / p.rate_bytes_per_s(link)
        for i in movers:
            # Hall: every boundary whose window set lies inside boundary i's (i' >= i).
            lo, hi = p.transfer_windows(link, i)
            m.addCons(demand_s * quicksum(moved[j] for j in movers if j >= i)
                      <= quicksum(free[link][lo:hi + 1]), name=f"hall_{link}_{i}")
        if link in ("d2h", "h2d"):  # an NVMe boundary's hop: its one window, alone
            for i in v.nvme:
                w, _ = p.transfer_windows(link, i, Home.NVME)
                m.addCons(demand_s * v.nvme[i] <= free[link][w], name=f"hop_{link}_{i}")
    _add_hop_floors(m, p, v)


def _add_state(m: Model, p: Problem, v: _Vars) -> None:
    """The host state's homes where the MIP decides them (docs/planner.md "Host state on
    NVMe"; capacities and window traffic are in `_add_capacity` and `_add_links`).

    A layer a block re-runs keeps its compute copy in DRAM: one path edge covers each
    layer, so the blocks re-running layer k plus its copy's NVMe home sum to at most 1
    (`copy_not_rerun_{k}`). The update phase after the step is a flow shop through
    `STATE_STAGING_GROUPS` buffers, as the simulator runs it: per layer j, in seconds
    after the step, its reads end at `C1_j` (after the previous reads, and after layer
    j-3's writes freed its buffer), its update at `C2_j` (after its reads and the previous
    update), its writes at `C3_j` (after its update and the previous writes); these rows
    are the longest paths of that schedule, exact at the minimum. The next forward waits
    for layer j's update `C2_j - (j-1)(f + o_f)` seconds (where the compute is the host's
    cores, for the whole update), `update_exposed_s` in the objective."""
    if not v.state:
        return
    L, S = p.num_layers, p.state_sizes
    copies = v.state.get("copies", {})
    for k, q in copies.items():
        rerun = [xv for (s, e), xv in v.x.items() if e - s >= 2 and s < k < e]
        if rerun:
            m.addCons(quicksum(rerun) + q <= 1, name=f"copy_not_rerun_{k}")
    c1, c2, c3 = ([m.addVar(f"update_{name}_s_{j}", lb=0.0) for j in range(1, L + 1)]
                  for name in ("read", "done", "written"))
    first_s, u_s = p.first_update_s, p.layer_update_s
    after_first = p.resident_update == "host" or not p.device_runs_async
    for i in range(L):  # layer j = i + 1
        read, written = update_io_bytes(v.state, S, i + 1)
        r_s, w_s = read * (1 / p.nvme_read_bytes_per_s), written * (1 / p.nvme_write_bytes_per_s)
        m.addCons(c1[i] >= (c1[i - 1] if i else 0.0) + r_s, name=f"update_read_after_{i + 1}")
        if i >= STATE_STAGING_GROUPS:
            m.addCons(c1[i] >= c3[i - STATE_STAGING_GROUPS] + r_s, name=f"update_buffer_{i + 1}")
        m.addCons(c2[i] >= c1[i] + u_s, name=f"update_after_read_{i + 1}")
        m.addCons(c2[i] >= (c2[i - 1] if i else (first_s if after_first else 0.0)) + u_s,
                  name=f"update_after_update_{i + 1}")
        m.addCons(c3[i] >= c2[i] + w_s, name=f"update_write_after_{i + 1}")
        if i:
            m.addCons(c3[i] >= c3[i - 1] + w_s, name=f"update_write_order_{i + 1}")
        if not p.nvme_full_duplex:  # one drive lane: the write of j after the read of j+2
            ahead = min(i + STATE_STAGING_GROUPS - 1, L - 1)
            m.addCons(c3[i] >= c1[ahead] + w_s, name=f"update_write_after_read_{i + 1}")
    e = m.addVar("update_exposed_s", lb=0.0)
    if p.host_on_compute:  # the update takes the compute's cores: the step pays it whole
        m.addCons(e >= c2[L - 1] + p.head_update_s, name="update_whole")
    else:
        m.addCons(e >= first_s, name="update_first_late")
        for i in range(L):
            m.addCons(e >= c2[i] - i * p.fwd_run_s, name=f"update_late_{i + 1}")
        m.addCons(e >= c2[L - 1] + p.head_update_s - p.prologue_s - L * p.fwd_run_s,
                  name="update_head_late")
    v.update_exposed = e


def _free_deltas_s(p: Problem, edges: list[tuple[int, int]], windows: dict[str, set[int]],
                   base_dur: list[float], base_bytes: dict[str, list[float]]
                   ) -> dict[tuple[str, int], list[tuple[tuple[int, int], float]]]:
    """(link, window) -> [(edge, seconds that edge alone adds to the window's free time
    on the link)] for the given windows of each link, from `Problem`'s cost methods (a
    block's recompute lengthens `B_e`, its weight re-stream takes H2D time there and one
    window earlier), against the windows without blocks (`base_dur`, `base_bytes`)."""
    deltas: dict[tuple[str, int], list[tuple[tuple[int, int], float]]] = {}
    for edge in edges:
        if edge[1] - edge[0] < 2:
            continue
        # elsewhere the block changes nothing; both links' hops may share a window
        changed = {w: p.one_block_window(edge, w) for w in p.block_windows(edge)
                   if any(w in wanted for wanted in windows.values())}
        for link, wanted in windows.items():
            rate = p.rate_bytes_per_s(link)
            for w in sorted(wanted.intersection(changed)):
                dur, h2d_bytes = changed[w]
                # a block moves weights only: the other links' bytes are the base's
                nbytes = h2d_bytes if link == "h2d" else base_bytes[link][w]
                d = dur - base_dur[w] - (nbytes - base_bytes[link][w]) / rate
                if d:
                    deltas.setdefault((link, w), []).append((edge, d))
    return deltas


def _add_hop_floors(m: Model, p: Problem, v: _Vars) -> None:
    """Exposure an NVMe boundary's hop forces, whatever the LP does with the blocks.

    With n_i = 1 no edge jumps over i and no block starts at i, so the only blocks that
    could lengthen the hop window (those ending at its layer) are off: the window's free
    time is at most its base free time plus, per end boundary, the best gain of a block
    compatible with n_i = 1 into it (at most one edge enters a boundary). Where a
    boundary does not fit that, `e_w >= (A / rate - free_max) n_i` is valid, and much
    stronger than the hop row, whose LP lengthens the window by a fraction of a block that
    cannot coexist with the hop (without it tight 64-layer chains stop at the time
    limit, docs/planner.md "The MIP")."""
    if not v.nvme:
        return
    hop = {link: {i: p.transfer_windows(link, i, Home.NVME)[0] for i in v.nvme}
           for link in ("d2h", "h2d")}
    base_dur, base_bytes = p.window_durations_s({}), p.mandatory_bytes({})
    deltas = _free_deltas_s(p, list(v.x), {k: set(ws.values()) for k, ws in hop.items()},
                            base_dur, base_bytes)
    for link, windows in hop.items():
        rate = p.rate_bytes_per_s(link)
        demand_s = p.boundary_bytes / rate
        for i, w in windows.items():
            best_into: dict[int, float] = {}  # per end boundary: edges into it exclude
            for (s, e), d in deltas.get((link, w), []):  # each other, so take the best
                if not s < i < e and s != i:
                    best_into[e] = max(best_into.get(e, 0.0), d)
            free_max = base_dur[w] - base_bytes[link][w] / rate + sum(best_into.values())
            if demand_s > free_max:
                m.addCons(v.exposed[w] >= (demand_s - free_max) * v.nvme[i],
                          name=f"hop_floor_{link}_{i}")


def _add_objective(m: Model, p: Problem, v: _Vars, elastic: bool) -> None:
    if elastic:  # how far the budgets are from feasible, in GiB
        m.setObjective(quicksum(v.slack.values()), "minimize")
        return
    recompute = quicksum(p.block_cost_s(s, e) * xv for (s, e), xv in v.x.items())
    ties = (TIE_MATERIALIZE_S * quicksum(_home_sum(v, i) for i in range(p.num_layers + 1))
            + TIE_OFFLOAD_S * quicksum(v.cpu.values()) + TIE_NVME_S * quicksum(v.nvme.values()))
    update = 0.0 if v.update_exposed is None else v.update_exposed
    state_ties = TIE_NVME_S * quicksum(q for part in v.state.values() for q in part.values())
    m.setObjective(recompute + quicksum(v.exposed) + update + ties + state_ties, "minimize")


def _fix_homes(m: Model, v: _Vars, homes: list[Home]) -> None:
    for i, home in enumerate(homes):
        for kind, table in ((Home.GPU, v.gpu), (Home.CPU, v.cpu), (Home.NVME, v.nvme)):
            if i in table:
                value = 1.0 if home == kind else 0.0
                m.chgVarLb(table[i], value)
                m.chgVarUb(table[i], value)
            elif home == kind:
                raise ValueError(f"boundary {i} cannot be homed {kind.value}: its offload or "
                                 "reload window set is empty (too close to the last layer)")


def build_milp(p: Problem, *, allow_cpu: bool = True, allow_nvme: bool = True,
               fixed_homes: list[Home] | None = None, elastic: bool = False,
               fixed_state: StateHomes | None = None) -> tuple[Model, _Vars]:
    """The SCIP model of `p`; `fixed_homes` pins every boundary (baselines), `fixed_state`
    the state's homes where the MIP decides them, `elastic` adds capacity slack and
    minimizes it (to name what an infeasible request lacks)."""
    edges = p.edges()
    if fixed_homes is not None:  # the full model, plus a baseline's blocks longer than K
        kept = [i for i, h in enumerate(fixed_homes) if h != Home.RECOMPUTE]
        copies = set(p.state.copies)  # never a block re-running an NVMe-homed copy
        edges += [b for b in itertools.pairwise(kept) if b[1] - b[0] > p.max_block
                  and not copies.intersection(range(b[0] + 1, b[1]))]
    m = Model("lazytrain_plan")
    m.hideOutput()
    v = _add_variables(m, p, edges, allow_cpu, allow_nvme)
    _add_path(m, p, v)
    _add_capacity(m, p, v, elastic)
    _add_links(m, p, v)
    _add_state(m, p, v)
    _add_objective(m, p, v, elastic)
    if fixed_homes is not None:
        _fix_homes(m, v, fixed_homes)
    for part, table in v.state.items() if fixed_state is not None else ():
        for j, q in table.items():
            value = 1.0 if fixed_state.on_nvme(part, j) else 0.0
            m.chgVarLb(q, value)
            m.chgVarUb(q, value)
    return m, v


def _read_homes(m: Model, v: _Vars, num_layers: int) -> tuple[Home, ...]:
    homes = []
    for i in range(num_layers + 1):
        home = Home.RECOMPUTE
        for kind, table in ((Home.GPU, v.gpu), (Home.CPU, v.cpu), (Home.NVME, v.nvme)):
            if i in table and m.getVal(table[i]) > 0.5:
                home = kind
        homes.append(home)
    return tuple(homes)


def _read_state(m: Model, v: _Vars) -> StateHomes | None:
    if not v.state:
        return None
    return StateHomes(**{part: tuple(sorted(j for j, q in table.items() if m.getVal(q) > 0.5))
                         for part, table in v.state.items()})


def _add_start(m: Model, v: _Vars, homes: list[Home] | tuple[Home, ...],
               state: StateHomes | None = None) -> None:
    """A known feasible point (the best baseline) as SCIP's first incumbent: a partial
    solution of the binaries, which SCIP completes by solving the LP of the rest."""
    sol = m.createPartialSol()
    for part, table in v.state.items() if state is not None else ():
        for j, q in table.items():
            m.setSolVal(sol, q, 1.0 if state.on_nvme(part, j) else 0.0)
    for i, home in enumerate(homes):
        for kind, table in ((Home.GPU, v.gpu), (Home.CPU, v.cpu), (Home.NVME, v.nvme)):
            if i in table:
                m.setSolVal(sol, table[i], 1.0 if home == kind else 0.0)
    chosen = set(itertools.pairwise([i for i, h in enumerate(homes) if h != Home.RECOMPUTE]))
    for edge, xv in v.x.items():
        m.setSolVal(sol, xv, 1.0 if edge in chosen else 0.0)
    m.addSol(sol)


def _step_gap(m: Model, status: str, step_floor_s: float) -> float:
    """(incumbent - bound) / incumbent's predicted step seconds."""
    if status == "optimal":
        return 0.0
    # The objective (recompute + exposure) is >= 0: a bound below it says nothing more.
    primal, dual = m.getPrimalbound(), max(m.getDualbound(), 0.0)
    return max(primal - dual, 0.0) / (step_floor_s + primal)


def solve_milp(p: Problem, *, time_limit_s: float = 60.0, gap: float = 0.01,
               allow_cpu: bool = True, allow_nvme: bool = True,
               fixed_homes: list[Home] | None = None, elastic: bool = False,
               start_homes: list[Home] | tuple[Home, ...] | None = None,
               start_state: StateHomes | None = None, fixed_state: StateHomes | None = None,
               first_feasible: bool = False, node_limit: int | None = None) -> Solution:
    """Solve `p`; `start_homes` (and where the MIP decides the state, `start_state`), a
    feasible point, seeds the search (warm start);
    `first_feasible` stops at the first incumbent SCIP's own search finds (no warm
    start then), and `node_limit` after that many branch-and-bound nodes (status
    "nodelimit"): deterministic stand-ins for a time limit in tests."""
    m, v = build_milp(p, allow_cpu=allow_cpu, allow_nvme=allow_nvme,
                      fixed_homes=fixed_homes, elastic=elastic, fixed_state=fixed_state)
    m.setParam("limits/time", max(time_limit_s, 0.01))
    # The gap is relative to the predicted step, not to the objective: the objective
    # (recompute + exposure) is often ~0 s, where a relative gap means nothing.
    step_floor_s = p.step_floor_s()
    m.setParam("limits/gap", 0.0)
    m.setParam("limits/absgap", gap * step_floor_s)
    if start_homes is not None and fixed_homes is None and not first_feasible:
        _add_start(m, v, start_homes, start_state)
    if first_feasible:
        m.setParam("limits/solutions", 1)
    if node_limit is not None:
        m.setParam("limits/nodes", node_limit)
    start = time.perf_counter()
    # Without the GIL: the re-planner solves on a background thread while training goes
    # on, and the model has no Python callbacks that would need it.
    m.optimizeNogil()
    solve_s = time.perf_counter() - start
    status = m.getStatus()
    if m.getNSols() == 0:
        return Solution(status=status, homes=None, gap=float("inf"), solve_s=solve_s)
    shortfall = {k: round(m.getVal(s) * GIB) for k, s in v.slack.items()}
    return Solution(
        status=status, homes=_read_homes(m, v, p.num_layers),
        exposed_s=tuple(max(m.getVal(e), 0.0) for e in v.exposed), objective_s=m.getObjVal(),
        gap=_step_gap(m, status, step_floor_s), solve_s=solve_s,
        shortfall_bytes={k: b for k, b in shortfall.items() if b > 0},
        state=_read_state(m, v))
