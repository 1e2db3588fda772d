"""A discrete-event run of one training step of a `Plan` on a profile.

Resources are serial FIFO queues: GPU compute, H2D, D2H, NVMe read, NVMe write (and
optionally the host optimizer). Unlike the MIP's window model, nothing waits at window
ends: an op starts when its queue is free and its dependencies are met, as on the
engine's streams:

* weights of the next window's layer are issued when a window starts (two device buffers,
  plus one for the first recomputed layer, prefetched one window before its block);
* a window's activation transfers are issued when it starts; an NVMe write waits for its
  boundary's D2H, an NVMe read for its write, an H2D for its read;
* B_e of block (s, e) first re-runs layers s+1..e-1 forward, each waiting for its
  re-streamed weights; the block cache holds them until layers e..s+1 ran backward;
* a backward waits for its input boundary's reload and for a free gradient buffer (two).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazytrain_accel.planning.events import EventQueue, SimOp
from lazytrain_accel.planning.plan import Home, Plan, TransferKind, run_fingerprint
from lazytrain_accel.planning.problem import STAGING_BOUNDARIES, Problem, build_problem
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model import ModelProfile

_KIND_RESOURCE = {TransferKind.H2D: "h2d", TransferKind.D2H: "d2h",
                  TransferKind.NVME_READ: "nvme_read", TransferKind.NVME_WRITE: "nvme_write"}


@dataclass(kw_only=True)
class SimulationResult:
    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: float
    exposed_by_link_s: dict[str, float]
    tokens_per_s: float
    tflops: float  # 6 * params * tokens / step_s
    peak_gpu_bytes: int
    peak_cpu_bytes: int
    peak_nvme_bytes: int
    optimizer_exposed_s: float  # 0 unless simulated with the host optimizer
    ops: list[SimOp] = field(default_factory=list)
    memory_bytes: dict[str, list[tuple[float, int]]] = field(default_factory=dict)


class _StepBuilder:
    """Issues the ops of one step in program order."""

    def __init__(self, p: Problem, plan: Plan) -> None:
        self.p, self.plan, self.q = p, plan, EventQueue()
        self.L = p.num_layers
        self.weights: dict[tuple[str, int], int] = {}  # ("layer"|"recompute", j) -> op
        self.window_start: dict[int, int] = {}
        self.fwd: dict[int, int] = {}
        self.bwd: dict[int, int] = {}
        self.recompute: dict[int, int] = {}
        self.head = -1
        self.grad: dict[int, int] = {}
        self.moves: dict[tuple[int, TransferKind], list[int]] = {}

    def weight(self, key: tuple[str, int], after_start: list[int], window: int) -> None:
        name = f"W{key[1]}" if key[0] == "layer" else f"RW{key[1]}"
        self.weights[key] = self.q.add(name, "h2d", self.p.layer_param_bytes
                                       / self.p.h2d_bytes_per_s, after_start=after_start,
                                       window=window)

    def compute(self, name: str, seconds: float, window: int, after_end: list[int]) -> int:
        op = self.q.add(name, "compute", seconds, after_end=after_end, window=window)
        self.window_start.setdefault(window, op)
        return op

    def forward(self, j: int) -> None:
        w = j - 1
        self.fwd[j] = self.compute(f"F{j}", self.p.fwd_s, w, [self.weights["layer", j]])
        self.issue(w, next_layer=j + 1 if j < self.L else None)

    def backward(self, j: int) -> None:
        p, w = self.p, 2 * self.L - j
        if j == self.L:
            self.head = self.compute("head", p.head_s, w, [])
        s, e = self.plan.block_of(j - 1)
        if e == j and e - s >= 2:
            for k in range(s + 1, e):
                self.recompute[k] = self.compute(f"R{k}", p.fwd_s, w,
                                                 [self.weights["recompute", k]])
                if k + 1 < e:
                    self.weight(("recompute", k + 1), [self.recompute[k]], w)
        deps = [self.weights["layer", j], *self.moves.get((j - 1, TransferKind.H2D), [])]
        if j + 2 in self.grad:
            deps.append(self.grad[j + 2])  # two gradient buffers
        self.bwd[j] = self.compute(f"B{j}", p.fwd_s + p.bwd_s, w, deps)
        self.issue(w, next_layer=j - 1 if j > 1 else None)
        # The gradients leave with the next window's transfers (the window model's D2H
        # slot); the last layer's form the tail of the step.
        self.grad[j] = self.q.add(f"G{j}", "d2h", p.layer_grad_bytes / p.d2h_bytes_per_s,
                                  after_end=[self.bwd[j]], window=w + 1)
        if j + 1 in self.grad:
            self.q.ops[self.grad[j + 1]].after_start.append(self.window_start[w])

    def issue(self, w: int, next_layer: int | None) -> None:
        """Transfers issued when window w starts."""
        start = [self.window_start[w]]
        for s, e in self.plan.blocks:  # first recomputed layer of the block after next
            if e - s >= 2 and 2 * self.L - e - 1 == w:
                self.weight(("recompute", s + 1), start, w)
        if next_layer is not None:  # F_L prefetches nothing: B_L reuses layer L's buffer
            self.weight(("layer", next_layer), start, w)
        for t in self.plan.transfers_in(w):
            op = self.q.add(f"{t.kind.value}:{t.boundary}", _KIND_RESOURCE[t.kind],
                            t.bytes / self._rate(t.kind), after_start=start, window=w)
            self.moves.setdefault((t.boundary, t.kind), []).append(op)

    def _rate(self, kind: TransferKind) -> float:
        p = self.p
        return {TransferKind.H2D: p.h2d_bytes_per_s, TransferKind.D2H: p.d2h_bytes_per_s,
                TransferKind.NVME_READ: p.nvme_read_bytes_per_s,
                TransferKind.NVME_WRITE: p.nvme_write_bytes_per_s}[kind]

    def chain_moves(self) -> None:
        """NVMe write after its D2H, read after its write, H2D after its read; within one
        window the second hop is pipelined in chunks behind the first (starts after it
        starts, ends after it ends)."""
        order = (TransferKind.D2H, TransferKind.NVME_WRITE, TransferKind.NVME_READ,
                 TransferKind.H2D)
        ops = self.q.ops
        for i in range(self.L + 1):
            prev: list[int] = []
            for kind in order:
                hop = self.moves.get((i, kind), [])
                for op in hop:
                    for before in prev:
                        if ops[before].window < ops[op].window:
                            ops[op].after_end.append(before)
                        else:
                            ops[op].after_start.append(before)
                            ops[op].finish_after.append(before)
                prev = hop or prev
        # Two host bounce buffers: an NVMe boundary's D2H waits for the write of the NVMe
        # boundary two before it; its read for the H2D of the one two before it.
        on_nvme = [i for i, h in enumerate(self.plan.homes) if h == Home.NVME]
        for order, first, last in ((on_nvme, TransferKind.D2H, TransferKind.NVME_WRITE),
                                   (on_nvme[::-1], TransferKind.NVME_READ, TransferKind.H2D)):
            for before, i in zip(order, order[2:], strict=False):
                for op in self.moves[i, first][:1]:
                    self.q.depend(op, self.moves[before, last])

    def window_barriers(self) -> None:
        """A window begins when the previous window's compute and transfers are done: the
        MIP's window model, and what lets the engine free an offloaded boundary."""
        issued: dict[int, list[int]] = {}
        for k, op in enumerate(self.q.ops):
            if op.resource != "compute":
                issued.setdefault(op.window, []).append(k)
        for w, first in self.window_start.items():
            self.q.depend(first, issued.get(w - 1, []))

    def build(self) -> EventQueue:
        self.weight(("layer", 1), [], -1)
        for j in range(1, self.L + 1):
            self.forward(j)
        for j in range(self.L, 0, -1):
            self.backward(j)
        self.q.add("G_resident", "d2h", (self.p.tail_d2h_bytes - self.p.layer_grad_bytes)
                   / self.p.d2h_bytes_per_s, after_end=[self.bwd[1]], window=2 * self.L)
        self.chain_moves()
        self.window_barriers()
        return self.q


def _memory(b: _StepBuilder, plan: Plan) -> dict[str, list[tuple[float, int]]]:
    """(time, bytes delta) events per tier for every boundary's life."""
    ops, A, L = b.q.ops, b.p.boundary_bytes, b.L
    events: dict[str, list[tuple[float, int]]] = {"gpu": [], "cpu": [], "nvme": []}

    def live(tier: str, start_s: float, end_s: float) -> None:
        events[tier] += [(start_s, A), (end_s, -A)]

    def moves(i: int, kind: TransferKind) -> list[SimOp]:
        return [ops[k] for k in b.moves.get((i, kind), [])]

    for i, home in enumerate(plan.homes):
        made = 0.0 if i == 0 else ops[b.fwd[i]].end_s
        used = ops[b.head].end_s if i == L else ops[b.bwd[i + 1]].end_s
        if home == Home.GPU:
            live("gpu", made, used)
        elif home == Home.RECOMPUTE:
            live("gpu", made, ops[b.fwd[i + 1]].end_s)  # the next forward's input
            live("gpu", ops[b.recompute[i]].end_s, used)  # the block cache
        else:
            d2h, h2d = moves(i, TransferKind.D2H), moves(i, TransferKind.H2D)
            live("gpu", made, d2h[-1].end_s)
            live("gpu", h2d[0].start_s, used)
            if home == Home.CPU:
                live("cpu", d2h[0].start_s, h2d[-1].end_s)
            else:  # host bounce buffers on the way to and from the file
                writes, reads = moves(i, TransferKind.NVME_WRITE), moves(i, TransferKind.NVME_READ)
                live("cpu", d2h[0].start_s, writes[-1].end_s)
                live("cpu", reads[0].start_s, h2d[-1].end_s)
                live("nvme", writes[0].start_s, reads[-1].end_s)
    return events


def _peak(static_bytes: int, events: list[tuple[float, int]]) -> tuple[int, list]:
    """Peak bytes; at equal times frees come first (a buffer is reused as it is freed)."""
    level, peak, curve = static_bytes, static_bytes, [(0.0, static_bytes)]
    for t, delta in sorted(events, key=lambda ev: (ev[0], ev[1])):
        level += delta
        peak = max(peak, level)
        curve.append((t, level))
    return peak, curve


def _exposure(q: EventQueue) -> dict[str, float]:
    """Seconds the compute queue waited, charged to the link it waited for; the tail after
    the last compute to the link that finishes last."""
    by_link = {"h2d": 0.0, "d2h": 0.0, "nvme_read": 0.0, "nvme_write": 0.0}
    prev_end = 0.0
    for k in q.queues["compute"]:
        op = q.ops[k]
        if op.start_s > prev_end and op.blocked_by >= 0:
            by_link[q.ops[op.blocked_by].resource] += op.start_s - prev_end
        prev_end = op.end_s
    last = max(q.ops, key=lambda op: op.end_s)
    if last.end_s > prev_end:
        by_link[last.resource] += last.end_s - prev_end
    return by_link


def _optimizer_exposed_s(b: _StepBuilder, hardware: HardwareProfile, params_per_layer: int,
                         end_s: float) -> float:
    """Host updates run in forward order once each layer's gradients are home; the next
    step's forward of layer j waits only for update j."""
    rate, free_s, worst = hardware.cpu_optimizer_params_per_s, end_s, 0.0
    for j in range(1, b.L + 1):
        grads_home = b.q.ops[b.grad[j]].end_s
        free_s = max(free_s, grads_home) + params_per_layer / rate
        next_forward_s = end_s + b.p.prologue_s + (j - 1) * b.p.fwd_s
        worst = max(worst, free_s - next_forward_s)
    return max(worst, 0.0)


def simulate(plan: Plan, model: ModelProfile, hardware: HardwareProfile, *,
             include_optimizer: bool = False) -> SimulationResult:
    """One step of `plan`; refuses a plan made for another model, batch or machine."""
    plan.check_fingerprint(run_fingerprint(model, hardware))
    longest = max(e - s for s, e in plan.blocks)
    p = build_problem(model, hardware, max_recompute_block=longest)
    b = _StepBuilder(p, plan)
    q = b.build()
    q.run()
    step_s = max(op.end_s for op in q.ops)
    by_link = _exposure(q)
    optimizer_s = (_optimizer_exposed_s(b, hardware, model.geometry.layer_param_count, step_s)
                   if include_optimizer else 0.0)
    step_s += optimizer_s
    events = _memory(b, plan)
    peaks, curves = {}, {}
    # The planner's host staging for NVMe boundaries is tracked here as events instead.
    host_static = p.static_cpu_bytes - STAGING_BOUNDARIES * p.boundary_bytes
    for tier, static in (("gpu", p.static_gpu_bytes), ("cpu", host_static), ("nvme", 0)):
        peaks[tier], curves[tier] = _peak(static, events[tier])
    recompute_s = sum(q.ops[k].duration_s for k in b.recompute.values())
    compute_s = sum(q.ops[k].duration_s for k in q.queues["compute"]) - recompute_s
    return SimulationResult(
        step_s=step_s, compute_s=compute_s, recompute_s=recompute_s,
        exposed_s=sum(by_link.values()) + optimizer_s, exposed_by_link_s=by_link,
        tokens_per_s=p.tokens_per_step / step_s,
        tflops=6.0 * p.param_count * p.tokens_per_step / step_s / 1e12,
        peak_gpu_bytes=peaks["gpu"], peak_cpu_bytes=peaks["cpu"], peak_nvme_bytes=peaks["nvme"],
        optimizer_exposed_s=optimizer_s, ops=q.ops, memory_bytes=curves)
