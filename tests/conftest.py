"""Shared by every unit test: accelerate keeps process-wide singletons; reset them so each
test picks its own mixed precision and device."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState

# `prepare` sizes torch's thread pool for the free cores (lazytrain_accel/threads.py); on a
# busy test machine that would change the count between a reference run and a LazyTrain
# run that tests compare bit for bit. Keep the count torch started with
# (tests/test_threads.py checks the rule itself).
os.environ.setdefault("LAZYTRAIN_THREADS", str(torch.get_num_threads()))
# The suite proves the overlapped update on this CPU device, where `overlap_step="auto"`
# runs it serially (run/step.py `update_overlaps`; tests/frontends/test_one_step.py
# checks that default, and the serial path where a test sets it off).
os.environ.setdefault("LAZYTRAIN_OVERLAP_STEP", "1")


#: Words in a test module's source that say its tests start processes, and of those, the
#: ones that say they start several ranks of one launch (`pytest_collection_modifyitems`).
_STARTS_PROCESSES = ("subprocess", "multiprocessing", "accelerate.commands.launch")
_STARTS_RANKS = ("--num_processes", "num_processes=", "init_process_group", "mp.spawn")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers by rule, not by hand, over every collected test (tests/ and
    integration_tests/): `subprocess` where the test's module starts processes,
    `multirank` where it launches several ranks (`./dev.sh test-fast` leaves both out,
    and `slow`)."""
    sources: dict[Path, str] = {}
    for item in items:
        path = Path(item.path)
        if path not in sources:
            sources[path] = path.read_text()
        if any(word in sources[path] for word in _STARTS_PROCESSES):
            item.add_marker(pytest.mark.subprocess)
        if any(word in sources[path] for word in _STARTS_RANKS):
            item.add_marker(pytest.mark.multirank)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def errors_of_concurrent_calls() -> Callable[[Callable[[], object]], list[BaseException]]:
    """Call a function 200 times on each of 4 threads at once; the errors raised (each
    ends its thread's calls). For writers that must not take each other's files."""
    def run(call: Callable[[], object]) -> list[BaseException]:
        errors: list[BaseException] = []

        def repeat() -> None:
            try:
                for _ in range(200):
                    call()
            except BaseException as err:  # reported to the test, on its thread
                errors.append(err)

        threads = [threading.Thread(target=repeat) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    return run


@pytest.fixture(scope="session")
def measured_hardware(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the first test that measures this machine (`hardware="auto"`: the GPU check's
    dry run, the demo, the user guide's `load_hardware("auto")`) leaves its profile for
    the tests after it, as a user's cache would: measuring takes 15-40 s of a loaded
    2-core machine, and the profile is the machine's, not the test's. Users copy its
    `hardware-*.json` into their cache before they run and back after. A test run alone
    measures; tests/profiling/test_measure.py tests the measuring itself."""
    return tmp_path_factory.mktemp("measured_hardware")
