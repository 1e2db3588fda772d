"""A discrete-event run of one training step of a `Plan` on a profile.

Resources are serial FIFO queues (GPU compute, H2D, D2H, NVMe read, NVMe write, the host
and device optimizers); an op starts when its queue is free and its dependencies are met,
as on the engine's streams, and a window starts when the previous window's compute and
transfers are done. Invariant: every dependency points to an op issued before it on its
queue, so no plan can deadlock (`_check_order`). The ops mirror the engine: its weight
slots (`slots.py:WeightSlots`), boundary hops, recompute blocks, the host's staging and
folding, the layer-wise update in the engine's order (split by `owner_of_groups` on a
node). What each op waits for: docs/planner.md "The simulator" and "The step as windows".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazytrain_accel.planning.events import EventQueue, SimOp
from lazytrain_accel.planning.node import owner_of_groups
from lazytrain_accel.planning.plan import (
    Home,
    Plan,
    Prediction,
    TransferKind,
    backward_window,
    forward_window,
)
from lazytrain_accel.planning.problem import LINKS, Problem, build_problem
from lazytrain_accel.planning.slots import WeightSlots, weight_slots
from lazytrain_accel.planning.state import (
    STATE_STAGING_GROUPS,
    copy_read_window,
    grad_write_window,
    update_io_bytes,
    weights_of,
)
from lazytrain_accel.profiling.fingerprint import run_fingerprint
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.model_configs import with_loss_chunk, with_tiles
from lazytrain_accel.profiling.profile import ModelProfile

#: The resource name of the host optimizer's ops (a lane of its own in the timeline).
HOST_OPTIMIZER = "host_optimizer"
#: The residents' update on the GPU (`Plan.resident_update="device"`): before the next
#: step's compute on the same stream, so a lane of its own in this step's timeline.
DEVICE_OPTIMIZER = "device_optimizer"
#: The host's work per transfer on a GPU (on a CPU device it is the compute's lane).
HOST = "host"
#: The update phase's reads and writes of the host state homed on NVMe (`state.py`):
#: after the step, beside the next forward, as the update itself.
STATE_READ = "state_read"
STATE_WRITE = "state_write"
#: The lanes of the update, which the step's own end and exposure leave out.
OPTIMIZER_LANES = (HOST_OPTIMIZER, DEVICE_OPTIMIZER, STATE_READ, STATE_WRITE)


def host_optimizer_lane(share: int) -> str:
    """The lane of local rank `share`'s host update ("host_optimizer", "host_optimizer/1")."""
    return HOST_OPTIMIZER if share == 0 else f"{HOST_OPTIMIZER}/{share}"


def is_optimizer_lane(resource: str) -> bool:
    """Whether `resource` is an update lane (any share's)."""
    return resource.split("/")[0] in OPTIMIZER_LANES


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
    optimizer_exposed_s: float  # next forward waiting for an update (0 without it)
    # The engine's per-layer-run overhead (`Problem.overhead_s`), which compute_s and
    # recompute_s leave out, and the host's work per transfer on the compute's lane
    # (`Problem.host_on_compute`): step_s = compute_s + recompute_s + overhead_s + host_s
    # + exposed_s.
    overhead_s: float = 0.0
    host_s: float = 0.0
    ops: list[SimOp] = field(default_factory=list)
    memory_bytes: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def prediction(self) -> Prediction:
        """The figures a `Plan` carries (what `lazytrain plan` prints)."""
        return Prediction(
            step_s=self.step_s, compute_s=self.compute_s, recompute_s=self.recompute_s,
            exposed_s=self.exposed_s, exposed_by_link_s=dict(self.exposed_by_link_s),
            peak_gpu_bytes=self.peak_gpu_bytes, peak_cpu_bytes=self.peak_cpu_bytes,
            peak_nvme_bytes=self.peak_nvme_bytes, tokens_per_s=self.tokens_per_s,
            tflops=self.tflops, optimizer_exposed_s=self.optimizer_exposed_s,
            overhead_s=self.overhead_s, host_s=self.host_s)


class _StepBuilder:
    """Issues the ops of one step in program order."""

    def __init__(self, p: Problem, plan: Plan) -> None:
        self.p, self.plan, self.q = p, plan, EventQueue()
        self.L = p.num_layers
        self.slots = WeightSlots(weight_slots(plan))
        self.slot_op = [-1] * self.slots.count  # the load op that filled each slot
        self.running: int | None = None  # the slot of the layer computing now
        self.weights: dict[tuple[str, int], int] = {}  # ("layer"|"recompute", j) -> op
        self.window_start: dict[int, int] = {}
        self.fwd: dict[int, int] = {}
        self.bwd: dict[int, int] = {}
        self.recompute: dict[int, int] = {}
        self.head = self.resident = -1
        self.grad: dict[int, int] = {}
        self.moves: dict[tuple[int, TransferKind], list[int]] = {}
        # The host's work per transfer (`Problem.stage_s`, `fold_s`), where priced: before
        # each layer run the engine stages what it prefetches there (and folds the
        # gradients `fold_in` names for its window), on the compute's thread (`host_on_compute`)
        # or the host's own lane, whose kernels the device runs after it.
        self.host_priced = p.stage_s > 0 or p.fold_s > 0
        self.host_lane = "compute" if p.host_on_compute else HOST
        self.host_op: int | None = None  # the host op of the layer run issued last
        self.host_ops: list[int] = []
        self.loads: list[int] = []  # weight loads in issue order (two staging buffers)
        self.fold_op: dict[int, int] = {}  # layer -> the host op that folded its gradients
        # The host state homed on NVMe (`Plan.state`): per layer, the window that reads its
        # compute copy and the one that writes its gradient, and those ops once issued.
        L, folds = self.L, p.fold_s > 0
        self.copy_reads_in = {copy_read_window(j, L): j for j in plan.state.copies
                              if copy_read_window(j, L) is not None}
        self.grad_writes_in = {grad_write_window(j, L, folds=folds): j
                               for j in plan.state.grads}
        self.copy_read: dict[int, int] = {}
        self.grad_write: dict[int, int] = {}

    def weight(self, key: tuple[str, int], after_start: list[int], window: int,
               after_end: tuple[int, ...] = ()) -> None:
        slot = self.slots.keep(key[1])  # a layer still held is not loaded again
        if slot is None:
            name = f"W{key[1]}" if key[0] == "layer" else f"RW{key[1]}"
            staged = self.stage() if self.host_priced else []
            op = self.q.add(name, "h2d", self.p.layer_param_bytes / self.p.h2d_bytes_per_s,
                            after_start=after_start, after_end=[*staged, *after_end],
                            window=window)
            self.loads.append(op)
            busy = () if self.running is None else (self.running,)
            slot = self.slots.pick(busy=busy, for_prefetch=False)
            assert slot is not None  # two slots or more, one running
            self.slots.filled(slot, key[1])
            self.slot_op[slot] = op
        self.weights[key] = self.slot_op[slot]

    def stage(self) -> list[int]:
        """A load's staging on the current host op, once the H2D copy that last read its
        staging buffer (two loads back) is done: the op the load's copy waits for."""
        host = self.host_op
        assert host is not None  # build() opens a host op before the first load
        self.q.ops[host].duration_s += self.p.stage_s
        if len(self.loads) >= 2:
            self.q.depend(host, [self.loads[-2]])
        return [host]

    def host(self, name: str, window: int) -> int:
        """A host op (its work added as the engine does it: `stage`, folds)."""
        self.host_op = self.q.add(f"H:{name}", self.host_lane, 0.0, window=window)
        self.host_ops.append(self.host_op)
        return self.host_op

    def compute(self, name: str, seconds: float, window: int, after_end: list[int],
                layer: int | None = None) -> int:
        if self.host_priced:  # before the run, not gated by the window's barrier: the
            # engine stages its prefetch, and folds, before it waits for the run's weights
            host = self.host(name, window)
            if not self.p.host_on_compute:  # the host issues the run's kernels after it
                after_end = [*after_end, host]
            self.fold(window, host)
        op = self.q.add(name, "compute", seconds, after_end=after_end, window=window)
        self.window_start.setdefault(window, op)
        if layer is not None:
            self.running = self.slots.ran(layer)
        return op

    def fold(self, window: int, host: int) -> None:
        """At a backward window's first run, the host folds layer j+3's gradients (B_j's
        window: `Problem.fold_in`) once their copy is done."""
        layer = self.p.fold_in(window)
        if window not in self.window_start and self.p.fold_s > 0 and layer is not None:
            self.q.ops[host].duration_s += self.p.fold_s
            self.q.depend(host, [self.grad[layer]])
            self.fold_op[layer] = host

    def forward(self, j: int) -> None:
        w = forward_window(j, self.L)
        self.fwd[j] = self.compute(f"F{j}", self.p.fwd_run_s, w, [self.weights["layer", j]], j)
        if j == self.L:
            self.slots.forget_all_but(j)
        self.issue(w, next_layer=j + 1 if j < self.L else j)  # B_L runs on F_L's buffer
        if j == self.L:  # in F_L's window: window L's transfers start after it
            self.head = self.compute("head", self.p.head_s + self.p.step_overhead_s, w, [])

    def backward(self, j: int) -> None:
        p, w = self.p, backward_window(j, self.L)
        s, e = self.plan.block_of(j - 1)
        if e == j and e - s >= 2:
            for k in range(s + 1, e):
                self.recompute[k] = self.compute(f"R{k}", p.fwd_run_s, w,
                                                 [self.weights["recompute", k]], k)
                if k + 1 < e:
                    self.weight(("recompute", k + 1), [self.recompute[k]], w)
        deps = [self.weights["layer", j], *self.moves.get((j - 1, TransferKind.H2D), [])]
        if j + 2 in self.grad:
            deps.append(self.grad[j + 2])  # two gradient buffers
        self.bwd[j] = self.compute(f"B{j}", p.bwd_run_s, w, deps, j)
        if j < self.L:  # the previous layer's gradients leave while this window computes
            self.gradients(j + 1, [self.window_start[w]], w)
        self.issue(w, next_layer=j - 1 if j > 1 else None)

    def gradients(self, j: int, after_start: list[int], window: int) -> None:
        """Layer j's weight gradients to the host, in the window after its backward (the
        window model's D2H slot); layer 1's form the tail of the step."""
        self.grad[j] = self.q.add(f"G{j}", "d2h",
                                  self.p.layer_grad_bytes / self.p.d2h_bytes_per_s,
                                  after_end=[self.bwd[j]], after_start=after_start,
                                  window=window)

    def issue(self, w: int, next_layer: int | None) -> None:
        """Transfers issued when window w starts."""
        start = [self.window_start[w]]
        self.state_io(w, start)
        for s, e in self.plan.blocks:  # first recomputed layer of the block after next
            if e - s >= 2 and backward_window(e, self.L) - 1 == w:
                self.weight(("recompute", s + 1), start, w)
        if next_layer is not None:  # a backward load of a copy homed on NVMe reads it first
            read = self.copy_read.get(next_layer) if w >= self.L else None
            self.weight(("layer", next_layer), start, w, () if read is None else (read,))
        for t in self.plan.transfers_in(w):
            op = self.q.add(f"{t.kind.value}:{t.boundary}", t.kind.value,
                            t.bytes / self.p.rate_bytes_per_s(t.kind.value),
                            after_start=start, window=w)
            self.moves.setdefault((t.boundary, t.kind), []).append(op)

    def state_io(self, w: int, start: list[int]) -> None:
        """The NVMe-homed state's traffic of window w (`state.py`): a compute copy read for
        the next window's backward load, a gradient written once the host has it."""
        p = self.p
        j = self.copy_reads_in.get(w)
        if j is not None:
            self.copy_read[j] = self.q.add(
                f"CR{j}", "nvme_read", p.state_sizes.copies_bytes / p.nvme_read_bytes_per_s,
                after_start=start, window=w)
        j = self.grad_writes_in.get(w)
        if j is not None:
            home = self.fold_op.get(j, self.grad[j])
            self.grad_write[j] = self.q.add(
                f"GW{j}", "nvme_write", p.state_sizes.grads_bytes / p.nvme_write_bytes_per_s,
                after_start=start, after_end=[home], window=w)

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
        if self.host_priced:
            self.host("prologue", -1)
        self.weight(("layer", 1), [], -1)
        for j in range(1, self.L + 1):
            self.forward(j)
        for j in range(self.L, 0, -1):
            self.backward(j)
        end = self.p.num_windows  # after the last window: the tail of the step
        self.gradients(1, [], end)
        self.resident = self.q.add(
            "G_resident", "d2h", (self.p.tail_d2h_bytes - self.p.layer_grad_bytes)
            / self.p.d2h_bytes_per_s, after_end=[self.bwd[1]], window=end)
        if self.p.fold_s > 0:  # the engine's drain at the end of the backward
            tail = [j for j in range(1, self.L + 1) if j not in self.fold_op]
            host = self.host("drain", end)
            self.q.ops[host].duration_s = len(tail) * self.p.fold_s
            self.q.depend(host, [self.grad[j] for j in tail])
            self.fold_op.update(dict.fromkeys(tail, host))
        self.chain_moves()
        self.window_barriers()
        return self.q

    def update_owners(self) -> list[int]:
        """The share that updates each group (U_embed, U1..UL, U_head), by the engine's
        rule; residents updated on the device are every rank's and weigh nothing."""
        p = self.p
        head = p.head_update_param_count
        every = (0, self.L + 1) if p.resident_update == "device" else ()
        return owner_of_groups([p.resident_update_param_count - head,
                                *[p.layer_update_param_count] * self.L, head],
                               p.gpus_per_node, every_rank=every)

    def host_optimizer(self, hardware: HardwareProfile) -> list[int]:
        """The update in the engine's order, one group after the other on each share's
        "host_optimizer" lane: U_embed, U1..UL, U_head; each once its gradients are
        home (the residents' leave last, `G_resident`). With the residents updated on the
        device: U_device (once every layer's gradients are home: the clip coefficient),
        and U1..UL on the host, beside it on an async device, else after it. On a node,
        each group on its owner's lane (`update_owners`) at the share's rate."""
        p, end = self.p, self.p.num_windows
        owners = self.update_owners()
        if p.resident_update == "device":
            first = self.q.add("U_device", DEVICE_OPTIMIZER, p.device_update_s,
                               after_end=[self.resident, self.grad[1]], window=end)
        else:
            first = self.q.add("U_embed", host_optimizer_lane(owners[0]),
                               p.first_update_s,
                               after_end=[self.resident], window=end)
        # The host's layers start with a GPU's queued residents' update (they run side by
        # side), after a CPU device's (it runs on the training thread first) or, on the
        # share that runs it, U_embed.
        beside = p.resident_update == "device" and hardware.device_runs_async
        ops, writes = [first], []
        streamed = self.plan.state.any  # every group through the update phase's buffers
        weights = weights_of(self.plan.state)
        # a drive that cannot read and write at once takes the writes on the reads' lane
        write_lane = STATE_WRITE if p.nvme_full_duplex else STATE_READ
        reads: dict[int, int] = {}

        def read(j: int) -> None:
            """Group j's state from NVMe (none for a group all in DRAM) into the buffer
            group j-3 held, once that group has been written back: issued as the engine
            issues it, the first three at the start, the next as a write frees one."""
            deps = [self.fold_op.get(j, self.grad[j]), self.bwd[1],
                    *([self.grad_write[j]] if j in self.grad_write else [])]
            if j > STATE_STAGING_GROUPS:
                deps.append(writes[j - 1 - STATE_STAGING_GROUPS])
            read_bytes = update_io_bytes(weights, p.state_sizes, j)[0]
            reads[j] = self.q.add(f"SR{j}", STATE_READ, read_bytes / p.nvme_read_bytes_per_s,
                                  after_end=deps, window=end)

        for j in range(1, min(STATE_STAGING_GROUPS, self.L) + 1) if streamed else ():
            read(j)
        for j in range(1, self.L + 1):
            after = not beside and (p.resident_update == "device" or owners[j] == owners[0])
            home = reads[j] if streamed else self.fold_op.get(j, self.grad[j])
            ops.append(self.q.add(f"U{j}", host_optimizer_lane(owners[j]),
                                  p.layer_update_s,
                                  after_end=[home] + ([first] if after else []),
                                  after_start=[first] if beside else [], window=end))
            if streamed:  # written behind, in update order; its buffer free after
                write_bytes = update_io_bytes(weights, p.state_sizes, j)[1]
                writes.append(self.q.add(f"SW{j}", write_lane,
                                         write_bytes / p.nvme_write_bytes_per_s,
                                         after_end=[ops[-1]], window=end))
                if j + STATE_STAGING_GROUPS <= self.L:
                    read(j + STATE_STAGING_GROUPS)
        if p.resident_update == "host":
            ops.append(self.q.add("U_head", host_optimizer_lane(owners[-1]), p.head_update_s,
                                  after_end=[self.resident], window=end))
        return ops


def _check_order(q: EventQueue) -> None:
    """Every dependency of an op was issued before it: with FIFO queues, the op issued
    first among the queue heads can always start, so the step cannot deadlock."""
    for k, op in enumerate(q.ops):
        late = [d for d in (*op.after_end, *op.after_start, *op.finish_after) if d >= k]
        if late:
            raise AssertionError(f"simulator op {op.name} depends on ops issued after it "
                                 f"({[q.ops[d].name for d in late]}): a schedule bug")


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


def _exposure(q: EventQueue, step_ops: list[SimOp]) -> dict[str, float]:
    """Seconds the compute queue waited, charged to the link it waited for; the tail after
    the last compute to the link that finishes last."""
    by_link = dict.fromkeys(LINKS, 0.0)  # and the host's lane on a GPU, where it binds

    def charge(resource: str, seconds: float) -> None:
        by_link[resource] = by_link.get(resource, 0.0) + seconds

    prev_end = 0.0
    for k in q.queues["compute"]:
        op = q.ops[k]
        if op.start_s > prev_end and op.blocked_by >= 0:
            charge(q.ops[op.blocked_by].resource, op.start_s - prev_end)
        prev_end = op.end_s
    last = max(step_ops, key=lambda op: op.end_s)
    if last.end_s > prev_end:
        charge(last.resource, last.end_s - prev_end)
    return by_link


def _optimizer_exposed_s(b: _StepBuilder, updates: list[int], step_s: float) -> float:
    """How long the next step waits for the optimizer (`updates`: U_embed or U_device,
    U1..UL, then U_head on the host). It starts once the first has ended; its forward of
    layer j would start at step_s + prologue + (j-1) f, and layer j's weights stream to
    the device (P/h2d, the prologue's length) only once Uj has ended; its head, at
    step_s + prologue + L f, needs U_head.

    Where the device's compute is the host's cores (`host_on_compute`: a CPU device, the
    emulated device), the update takes those cores from the next forward rather than
    running beside it: the step pays each lane's whole update (the slowest lane's), as
    if it ran after the step (measured on a 2-core Xeon: the overlapped step ran 1.0-1.1x
    the serial one, docs/benchmarks.md "The plan at prepare")."""
    ops, p = b.q.ops, b.p
    if p.host_on_compute and b.plan.state.any:  # the update waits for its reads too
        return max(ops[u].end_s for u in updates) - step_s
    if p.host_on_compute:
        lane_s: dict[str, float] = {}
        for u in updates:
            lane_s[ops[u].resource] = lane_s.get(ops[u].resource, 0.0) + ops[u].duration_s
        device_s = lane_s.pop(DEVICE_OPTIMIZER, 0.0)  # the training thread's, before them
        return device_s + max(lane_s.values(), default=0.0)
    first, *rest = (ops[u].end_s - step_s for u in updates)
    layers = rest[:b.L]
    late_s = [first] + [end_s - j * p.fwd_run_s for j, end_s in enumerate(layers)]
    if len(rest) > b.L:  # U_head
        late_s.append(rest[b.L] - p.prologue_s - b.L * p.fwd_run_s)
    return max([0.0, *late_s])


def simulate(plan: Plan, model: ModelProfile, hardware: HardwareProfile, *,
             include_optimizer: bool = True) -> SimulationResult:
    """One step of `plan` (with the host optimizer's overlapped update unless
    `include_optimizer=False`); refuses a plan made for another model, batch or machine.
    A profile with loss_chunk_tokens="auto" (None) takes the plan's loss head, one with
    tile_tokens="auto" (None) the plan's tiles and query blocks."""
    plan.check_fingerprint(run_fingerprint(model, hardware))
    if model.loss_chunk_tokens is None:
        model = with_loss_chunk(model, plan.loss_chunk_tokens)
    if model.tile_tokens is None:
        model = with_tiles(model, plan.tile_tokens, plan.attention_block_tokens)
    longest = max(e - s for s, e in plan.blocks)
    p = build_problem(model, hardware, max_recompute_block=longest,
                      resident_update=plan.resident_update, optimizer=plan.optimizer,
                      gpus_per_node=plan.gpus_per_node, nodes=plan.nodes,
                      node_layout=plan.node_layout, state=plan.state)
    b = _StepBuilder(p, plan)
    q = b.build()
    updates = b.host_optimizer(hardware) if include_optimizer else []
    _check_order(q)
    q.run()
    step_ops = [op for op in q.ops if not is_optimizer_lane(op.resource)]
    step_s = max(op.end_s for op in step_ops)
    by_link = _exposure(q, step_ops)
    optimizer_s = _optimizer_exposed_s(b, updates, step_s) if updates else 0.0
    step_s += optimizer_s
    events = _memory(b, plan)
    # Every rank of the node runs the plan in step: its host boundaries, N times over.
    events["cpu"] = [(t, delta * p.gpus_per_node) for t, delta in events["cpu"]]
    peaks, curves = {}, {}
    for tier, static in (("gpu", p.static_gpu_bytes), ("cpu", p.static_cpu_bytes),
                         ("nvme", p.nvme_state_bytes)):
        peaks[tier], curves[tier] = _peak(static, events[tier])
    # The compute queue's seconds split as the engine times them: layer compute (with the
    # head), recompute, and the per-run overhead outside the engine's layer timer.
    runs = len(b.recompute)
    overhead_s = p.overhead_s(runs)
    recompute_s = sum(q.ops[k].duration_s for k in b.recompute.values()) \
        - runs * p.fwd_overhead_s
    host_s = sum(q.ops[k].duration_s for k in b.host_ops) if p.host_on_compute else 0.0
    compute_s = sum(q.ops[k].duration_s for k in q.queues["compute"]) - recompute_s \
        - overhead_s - host_s
    return SimulationResult(
        step_s=step_s, compute_s=compute_s, recompute_s=recompute_s,
        exposed_s=sum(by_link.values()) + optimizer_s, exposed_by_link_s=by_link,
        tokens_per_s=p.tokens_per_step / step_s,
        tflops=6.0 * p.param_count * p.tokens_per_step / step_s / 1e12,
        peak_gpu_bytes=peaks["gpu"], peak_cpu_bytes=peaks["cpu"], peak_nvme_bytes=peaks["nvme"],
        optimizer_exposed_s=optimizer_s, overhead_s=overhead_s, host_s=host_s, ops=q.ops,
        memory_bytes=curves)
