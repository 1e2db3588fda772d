"""The loop the kill tests' job scripts share (`train_jobs.py`, `store_fill.py`): the
script imports torch and the package once, then each line on stdin forks a job, whose pid
is printed, and the jobs a test has killed so far are reaped. Imported from the scripts'
own folder (it is first on `sys.path` when a script runs as a file)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def serve_jobs(launch: Callable[[list[str]], None]) -> None:
    """Fork a job per line of stdin, running `launch(the line's words)` in the child, which
    then exits; print each job's pid as it starts."""
    for line in sys.stdin:
        words = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                launch(words)
            finally:
                os._exit(0)
        print(pid, flush=True)
        while os.waitpid(-1, os.WNOHANG) != (0, 0):  # reap the jobs killed so far
            pass
