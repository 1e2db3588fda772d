"""A tiny discrete-event core: serial resources, each a FIFO of ops in issue order; an op
starts when its resource is free and its dependencies have started or ended."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SimOp:
    name: str
    resource: str
    duration_s: float
    window: int = -1
    after_end: list[int] = field(default_factory=list)
    after_start: list[int] = field(default_factory=list)
    finish_after: list[int] = field(default_factory=list)  # pipelined: ends after these end
    start_s: float = -1.0
    end_s: float = -1.0
    blocked_by: int = -1  # the dependency that set the start (-1: its own resource)


class EventQueue:
    def __init__(self) -> None:
        self.ops: list[SimOp] = []
        self.queues: dict[str, list[int]] = {}

    def add(self, name: str, resource: str, duration_s: float, *, after_end: list[int] = (),
            after_start: list[int] = (), window: int = -1) -> int:
        self.ops.append(SimOp(name=name, resource=resource, duration_s=duration_s,
                              window=window, after_end=list(after_end),
                              after_start=list(after_start)))
        self.queues.setdefault(resource, []).append(len(self.ops) - 1)
        return len(self.ops) - 1

    def depend(self, op: int, after_end: list[int]) -> None:
        self.ops[op].after_end += after_end

    def _try_start(self, idx: int, free_s: float) -> bool:
        op = self.ops[idx]
        deps = [(self.ops[d].end_s, d) for d in op.after_end]
        deps += [(self.ops[d].start_s, d) for d in op.after_start]
        ends = [self.ops[d].end_s for d in op.finish_after]
        if any(t < 0 for t, _ in deps) or any(t < 0 for t in ends):
            return False
        op.start_s, op.blocked_by = free_s, -1
        for t, d in deps:
            if t > op.start_s:
                op.start_s, op.blocked_by = t, d
        op.end_s = max([op.start_s + op.duration_s, *ends])
        return True

    def run(self) -> None:
        """Start every op; each pass advances every queue as far as it can."""
        heads = dict.fromkeys(self.queues, 0)
        free = dict.fromkeys(self.queues, 0.0)
        remaining = len(self.ops)
        while remaining:
            progressed = False
            for res, queue in self.queues.items():
                while heads[res] < len(queue) and self._try_start(queue[heads[res]], free[res]):
                    free[res] = self.ops[queue[heads[res]]].end_s
                    heads[res] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {r: self.ops[q[heads[r]]].name for r, q in self.queues.items()
                         if heads[r] < len(q)}
                raise RuntimeError(f"simulated step deadlocks; waiting ops: {stuck}")
