"""An emulated async device for CPU runs: a missing synchronization becomes a failure.

`EmulatedStreams` implements `Streams` with `is_async = True`, so the engine runs its
CUDA code paths on a CPU: each side stream is a worker thread with a FIFO queue, each
event a real completion flag; a copy's destination is poisoned at enqueue (a read before
the wait sees NaN); `claim` raises `BufferReuseError` for a staging buffer handed out
before its last copy was waited for; seeded jitter varies the orderings (errors name the
seed); links may be throttled to a byte rate on each stream's own clock, and a side
stream's intervals are timed by its worker. Compute runs on the host thread. Not shown:
the CUDA calls themselves (stream semantics, `record_stream`, pinned-memory DMA).
Design: docs/engine.md "Emulated async device".
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from lazytrain_accel.engine.device.streams import IoLink, Link
from lazytrain_accel.engine.stats import ElapsedInterval, Interval

#: Value written into integer destinations at enqueue (floats get NaN, bools True).
INT_SENTINEL = -0x5A5A5A5A
#: Upper bound of one jitter sleep, seconds.
DEFAULT_JITTER_S = 3e-4
#: A throttled copy lands in this many pieces, each at its share of the link time (the
#: last at the end), so a read before the copy's event sees poison however fast memcpy is.
THROTTLED_PIECES = 4
#: How long stopping a worker waits for its queued ops before giving up on it, seconds.
STOP_TIMEOUT_S = 60.0

#: An op of an emulated stream, called on its worker with the time the stream reaches it
#: (its clock: `_Worker.free_s`); it returns when it ended on that clock (None: now).
StreamOp = Callable[[float], "float | None"]

logger = logging.getLogger(__name__)


class BufferReuseError(RuntimeError):
    """A staging buffer was handed out again before the copy using it was waited for."""


def replay_hint(seed: int) -> str:
    return (f"emulated async device, seed {seed}: replay with LAZYTRAIN_EMULATE_ASYNC=1 "
            f"LAZYTRAIN_EMULATE_SEED={seed}")


@dataclass(kw_only=True, frozen=True)
class EmulationSettings:
    seed: int = 0
    jitter_s: float = DEFAULT_JITTER_S
    #: Byte rate per link ("h2d", "d2h", "nvme_read", "nvme_write"); missing = unthrottled.
    link_bytes_per_s: dict[str, float] = field(default_factory=dict)
    #: Poison each copy's destination (and an NVMe read's) at issue. Off only where the
    #: host's time is measured against a device's (bench/fidelity.py): the check is what
    #: proves the waits, and every test keeps it.
    poison_copies: bool = True

    @classmethod
    def from_env(cls) -> EmulationSettings | None:
        """Settings from `LAZYTRAIN_EMULATE_ASYNC` and `_SEED` (read in config.py), None
        when off. A bare `attach` has no hardware profile, so its links stay unthrottled
        (the plugin throttles them to its profile: `setup.emulation_for`)."""
        from lazytrain_accel.config import env_setting

        if not env_setting("emulate_async"):
            return None
        return cls(seed=env_setting("emulate_seed"))


class _Worker:
    """One emulated stream: a thread running queued ops in order.

    The thread is a daemon, so a forgotten engine never keeps the interpreter alive; it
    must therefore never be inside torch when the interpreter finalizes (a daemon thread
    taking the GIL back then is ended by `pthread_exit` from inside a C++ destructor:
    "terminate called without an active exception", exit status -6). `EmulatedStreams`
    stops and joins its workers when closed, collected, or at interpreter exit (a
    `weakref.finalize`, which runs before daemon threads are abandoned).
    """

    def __init__(self, name: str, rng: random.Random, jitter_s: float) -> None:
        self.name = name
        # (op, whether it is jittered first, when it was issued); None stops the thread
        self._queue: queue.SimpleQueue[tuple[StreamOp, bool, float] | None] = \
            queue.SimpleQueue()
        #: The stream's clock: when its last op ended (a throttled copy: when its last
        #: byte was due), so the next op begins at max(its issue, this).
        self.free_s = 0.0
        self._done = threading.Condition()
        self.enqueued = 0  # ops enqueued so far (an event's seq is this count)
        self.completed = 0
        self.jitter_slept_s = 0.0  # jitter so far: left out of the intervals it falls in
        self.error: BaseException | None = None
        self._rng, self._jitter_s = rng, jitter_s
        self._thread = threading.Thread(target=self._run, name=f"lazytrain-emulated-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, op: StreamOp, *, jitter: bool = True) -> int:
        self.enqueued += 1
        self._queue.put((op, jitter, time.perf_counter()))
        return self.enqueued

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            op, jitter, issued_s = item
            start_s = max(issued_s, self.free_s)
            if jitter and self._jitter_s:
                delay_s = self._rng.random() * self._jitter_s
                time.sleep(delay_s)  # late on purpose, whatever the stream's clock says
                start_s += delay_s
                self.jitter_slept_s += delay_s
            try:
                if self.error is None:
                    end_s = op(start_s)
                    self.free_s = time.perf_counter() if end_s is None else end_s
            except BaseException as err:  # surfaced on the host by the next wait
                self.error = err
            with self._done:
                self.completed += 1
                self._done.notify_all()

    def wait_for(self, seq: int) -> None:
        with self._done:
            self._done.wait_for(lambda: self.completed >= seq)
        if self.error is not None:
            raise RuntimeError(f"an emulated {self.name} copy failed") from self.error

    def stop(self) -> None:
        """Let the queued ops run, then end the thread (`join` waits for that)."""
        self._queue.put(None)

    def join(self) -> None:
        if self._thread is threading.current_thread():
            return  # collected on its own thread: it ends after this op
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("lazytrain: the emulated %s stream still runs %.0f s after it was "
                           "stopped: one of its ops waits for an event that never completes "
                           "(an engine bug: report it with the seed); it is left behind",
                           self.name, STOP_TIMEOUT_S)


class EmulatedEvent:
    """Completion of the ops `worker` had queued when recorded (None worker: done)."""

    def __init__(self, worker: _Worker | None, seq: int) -> None:
        self.worker, self.seq = worker, seq

    def query(self) -> bool:
        return self.worker is None or self.worker.completed >= self.seq

    def synchronize(self) -> None:
        if self.worker is not None:
            self.worker.wait_for(self.seq)


def poison_(tensor: torch.Tensor) -> None:
    """Fill `tensor` with a value no correct computation reads back unnoticed."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    elif tensor.dtype == torch.uint8:
        tensor.fill_(0xA5)
    else:
        tensor.fill_(max(INT_SENTINEL, torch.iinfo(tensor.dtype).min))


def _sleep_until(deadline_s: float) -> None:
    remaining = deadline_s - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`dst` and `src` in THROTTLED_PIECES flat pieces (one pair when they do not split)."""
    if (dst.numel() != src.numel() or dst.numel() < THROTTLED_PIECES
            or not (dst.is_contiguous() and src.is_contiguous())):
        return [(dst, src)]
    return list(zip(dst.view(-1).chunk(THROTTLED_PIECES), src.view(-1).chunk(THROTTLED_PIECES),
                    strict=True))


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor`'s memory with its own autograd version counter."""
    return torch.empty(0, dtype=tensor.dtype).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class EmulatedStreams:
    """`Streams` on a CPU with worker-thread side streams; see the module docstring."""

    is_async = True
    host_tier = "host_pinned"  # what the same buffers would cost on a GPU machine

    def __init__(self, device: torch.device, settings: EmulationSettings) -> None:
        self.device = device
        self.settings = settings
        self.seed = settings.seed
        self._workers = {link: _Worker(link, random.Random(f"{settings.seed}:{link}"),
                                       settings.jitter_s) for link in ("h2d", "d2h")}
        self._io_rngs = {link: random.Random(f"{settings.seed}:{link}")
                         for link in ("nvme_read", "nvme_write")}
        self._io_lock = threading.Lock()  # the I/O threads share the links' clocks
        self._io_busy_until: dict[str, float] = {}  # per link: when its last transfer ends
        self._local = threading.local()
        self._host_seen = dict.fromkeys(self._workers, 0)  # newest op the host waited for
        self._last_use: dict[int, tuple[str, int]] = {}  # storage -> (link, op) last using it
        self._stop = weakref.finalize(self, _stop_all, list(self._workers.values()))

    def _current(self) -> _Worker | None:
        return getattr(self._local, "worker", None)

    @contextmanager
    def copy_stream(self, link: Link) -> Iterator[None]:
        previous, self._local.worker = self._current(), self._workers[link]
        try:
            yield
        finally:
            self._local.worker = previous

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        worker = self._current()
        if worker is None:  # the compute stream is the host thread itself
            dst.copy_(src)
            return
        if self.settings.poison_copies:
            poison_(dst)  # bumps dst's version once, at issue, as a CUDA copy_ does
        else:
            torch.autograd.graph.increment_version(dst)  # as the fill would
        target = _alias(dst)  # the worker's write must not bump it a second time, later
        rate = self.settings.link_bytes_per_s.get(worker.name)
        nbytes = src.numel() * src.element_size()

        def op(start_s: float) -> float | None:
            if not rate:
                target.copy_(src)
                return None
            pieces = _pieces(target, src)
            for i, (dst_piece, src_piece) in enumerate(pieces, 1):  # lands as a DMA would:
                _sleep_until(start_s + nbytes / rate * i / len(pieces))  # at its time
                dst_piece.copy_(src_piece)
            return start_s + nbytes / rate

        seq = worker.submit(op)
        self._last_use[_storage_key(dst)] = self._last_use[_storage_key(src)] = (worker.name, seq)
        if seq % 1024 == 0:  # forget uses the host has already waited for
            self._last_use = {k: v for k, v in self._last_use.items()
                              if v[1] > self._host_seen[v[0]]}

    def record(self) -> EmulatedEvent:
        worker = self._current()
        return EmulatedEvent(worker, worker.enqueued if worker is not None else 0)

    def compute_waits(self, event: EmulatedEvent | None) -> None:
        worker = self._current()
        if event is None or event.worker is None:
            return
        if worker is None:
            self.host_waits(event)  # compute runs on the host: it blocks
        elif event.worker is not worker:  # stream order covers the same worker
            worker.submit(lambda _start_s: event.synchronize())

    def host_waits(self, event: EmulatedEvent | None) -> None:
        if event is None or event.worker is None:
            return
        name = event.worker.name
        try:
            event.synchronize()
        except RuntimeError as err:
            raise RuntimeError(f"{err}; {replay_hint(self.seed)}") from err.__cause__
        self._host_seen[name] = max(self._host_seen[name], event.seq)

    def claim(self, buffer: torch.Tensor) -> None:
        last = self._last_use.get(_storage_key(buffer))
        if last is None or self._host_seen[last[0]] >= last[1]:
            return
        link, seq = last
        raise BufferReuseError(
            f"a staging buffer ({buffer.numel()} x {buffer.dtype}) was handed out again "
            f"while {link} copy #{seq}, the last one using it, may still run (the host has "
            f"waited for copies up to #{self._host_seen[link]}): a wait on that copy's event "
            f"is missing before the buffer is reused; {replay_hint(self.seed)}")

    def empty_host(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        return None  # a queued copy holds references to its tensors until it ran

    def register_pinned(self, buffer: torch.Tensor, *, max_chunk_bytes: int) -> bool:
        return True  # host memory stands in for pinned memory here

    def poison(self, tensor: torch.Tensor) -> None:
        if self.settings.poison_copies:
            poison_(tensor)

    @contextmanager
    def io_link(self, link: IoLink, nbytes: int) -> Iterator[None]:
        """On an I/O thread (the spill's, the host state's): jitter before; throttled, the
        transfer ends no sooner than the link can carry `nbytes` after its previous one
        (one clock per link, whatever the thread: a drive serves its requests in turn)."""
        if self.settings.jitter_s:
            with self._io_lock:
                jitter_s = self._io_rngs[link].random() * self.settings.jitter_s
            time.sleep(jitter_s)
        start = time.perf_counter()
        yield
        rate = self.settings.link_bytes_per_s.get(link)
        if rate:
            with self._io_lock:
                end_s = self._io_busy_until[link] = (
                    max(start, self._io_busy_until.get(link, 0.0)) + nbytes / rate)
            _sleep_until(end_s)

    def set_link_rate(self, link: str, bytes_per_s: float | None) -> None:
        """Throttle `link` ("h2d", "d2h", "nvme_read", "nvme_write") to `bytes_per_s` from
        the next copy it issues on (None: unthrottled): a machine that drifts mid-run."""
        if link not in (*self._workers, *self._io_rngs):
            raise ValueError(f"link={link!r} is not one of "
                             f"{[*self._workers, *self._io_rngs]}")
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s={bytes_per_s} must be > 0 (None: unthrottled)")
        rates = {k: v for k, v in self.settings.link_bytes_per_s.items() if k != link}
        if bytes_per_s is not None:
            rates[link] = float(bytes_per_s)
        self.settings = replace(self.settings, link_bytes_per_s=rates)

    def start_interval(self) -> Callable[[], Interval]:
        """On a side stream: timestamps taken by its worker when it reaches each end
        (unjittered markers), less the jitter it slept between them (a GPU's copy engine
        is not late on purpose: the link's own time is what a CUDA event pair sees); on
        the compute stream (the host thread): the wall clock."""
        worker = self._current()
        if worker is None:
            start_s = time.perf_counter()
            return lambda: ElapsedInterval(time.perf_counter() - start_s)
        marks: list[float] = []

        def mark(start_s: float) -> float:
            marks.append(start_s - worker.jitter_slept_s)  # on the stream's clock
            return start_s

        worker.submit(mark, jitter=False)

        def stop() -> Interval:
            return _WorkerInterval(EmulatedEvent(worker, worker.submit(mark, jitter=False)),
                                   marks)

        return stop

    def close(self) -> None:
        self._stop()  # queued ops run first; runs once (also on collection and at exit)


class _WorkerInterval:
    """Two markers run by one emulated stream's worker: the time it spent between them."""

    def __init__(self, end: EmulatedEvent, marks: list[float]) -> None:
        self._end, self._marks = end, marks

    def query(self) -> bool:
        return self._end.query()

    def seconds(self) -> float:
        try:
            self._end.synchronize()
        except RuntimeError:
            return 0.0  # the stream failed: the engine's own wait on it raises that
        return self._marks[1] - self._marks[0]


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:  # all first: an op may wait for another worker's event
        worker.stop()
    for worker in workers:
        worker.join()
