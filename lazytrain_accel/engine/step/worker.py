"""`UpdateWorker`: the one thread of a run that runs each step's update, fed by a queue.

A job is a callable that catches its own errors (`LayerwiseUpdate.run` keeps them for
the training thread's next wait), so the worker outlives a failed step. The thread is a
daemon blocked on its queue between steps; `close()` (the engine's `detach`) and the
interpreter's exit (`atexit`, before torch finalizes) let the job in flight finish, then
join the thread. docs/engine.md "Optimizer/forward overlap".
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable

#: The name of every update worker's thread (a test counts them).
THREAD_NAME = "lazytrain-step"

_Job = Callable[[], None]
#: Every worker thread still running, with its queue: joined at the interpreter's exit.
_running: dict[threading.Thread, queue.SimpleQueue[_Job | None]] = {}
_running_lock = threading.Lock()


class UpdateWorker:
    """Runs submitted jobs one after another on one long-lived thread (started on the
    first `submit`)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = weakref.finalize(self, self._jobs.put, None)  # dropped: thread ends
        self._stop.atexit = False  # the exit joins every thread instead (`_join_all`)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def submit(self, job: _Job) -> None:
        """Queue `job` behind the jobs already queued."""
        if not self._stop.alive:
            raise RuntimeError("the update worker was closed; attach a new engine")
        if self._thread is None:
            # the target holds the queue, not the worker, so a dropped worker is collected
            self._thread = threading.Thread(target=_serve, args=(self._jobs,),
                                            name=THREAD_NAME, daemon=True)
            with _running_lock:
                _running[self._thread] = self._jobs
            self._thread.start()
        self._jobs.put(job)

    def close(self) -> None:
        """Let the queued jobs finish, then end and join the thread."""
        self._stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    try:
        while (job := jobs.get()) is not None:
            job()
            del job  # hold nothing of a finished step while idle
    finally:
        with _running_lock:
            _running.pop(threading.current_thread(), None)


@atexit.register
def _join_all() -> None:
    """At the interpreter's exit (after the main thread ended, before torch's own exit
    handlers, registered earlier): no worker is left inside torch while it finalizes."""
    with _running_lock:
        running = list(_running.items())
    for _, jobs in running:
        jobs.put(None)
    for thread, _ in running:
        thread.join()
