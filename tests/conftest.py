"""Shared by every unit test: accelerate keeps process-wide singletons; reset them so each
test picks its own mixed precision and device."""

from __future__ import annotations

import os
import shutil
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
# Kineto reads its log level once, when a process first profiles: a test profiling before
# the demo's (tests/optim/test_kernel_op.py, the optimizer doc's block) would leave it at
# the level that prints "USDT: ... profiler_start" into the demo's output, which
# tests/demo/test_demo_cli.py checks is clean. Quiet for every test process; the demo's
# own setting is exercised wherever it profiles first.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


#: Words in a test module's source that say its tests start processes, and of those, the
#: ones that say they start several ranks of one launch (`pytest_collection_modifyitems`).
_STARTS_PROCESSES = ("subprocess", "multiprocessing", "accelerate.commands.launch")
_STARTS_RANKS = ("--num_processes", "num_processes=", "init_process_group", "mp.spawn")


#: Seconds a module's tests took on one of two pytest-xdist workers (2 loaded cores,
#: 2026-12-06: `.ci/run`'s main pass, and a run of the modules its slowest-30 list does
#: not show; 2026-12-07: the node modules' new tests, the long sample less its 32K case),
#: for the modules of 25 s or more. Only the order in which the workers take
#: the modules follows from these (`_longest_modules_first`).
_MODULE_SECONDS = {
    "integration_tests/test_node_store_launch.py": 300,
    "tests/frontends/test_replanner.py": 180,
    "integration_tests/test_node_nvme_launch.py": 90,
    "tests/frontends/test_long_sample.py": 100,
    "tests/test_docs.py": 165,
    "integration_tests/test_trainer.py": 165,
    "integration_tests/test_trainer_node_launch.py": 160,
    "integration_tests/test_share_checkpoint_launch.py": 110,
    "integration_tests/test_user_scripts.py": 105,
    "tests/bench/test_gpu_check_dry_run.py": 80,
    "integration_tests/test_accelerate_launch.py": 80,
    "integration_tests/test_trainer_launch.py": 65,
    "integration_tests/test_qlora_launch.py": 55,
    "tests/frontends/test_trl_long_sample.py": 55,
    "integration_tests/test_replan_ranks.py": 50,
    "tests/planning/test_planner_properties.py": 50,
    "integration_tests/test_trainer_args.py": 50,
    "tests/frontends/test_trainer_async_checkpoint.py": 45,
    "integration_tests/test_launch_exit.py": 40,
    "integration_tests/test_node_state.py": 35,
    "integration_tests/test_node_store_crash.py": 32,
    "tests/faults/test_fault_async_checkpoint.py": 31,
    "tests/engine/test_emulated_engine.py": 31,
    "tests/demo/test_demo_cli.py": 29,
    "tests/planning/test_planner_simulate.py": 28,
    "integration_tests/test_peft_lora.py": 26,
}


def _longest_modules_first(items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker, the modules in `_MODULE_SECONDS` order, then the rest
    by their number of tests (as xdist's own `--dist loadfile` order), each module's tests
    in place. With `--no-loadscope-reorder` (dev.sh) the workers take the modules in this
    order, so the last ones handed out are short: by test count alone the 1-test launch
    modules (50 s each) came last, one worker running them while the other sat idle."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules, key=lambda m: (-_MODULE_SECONDS.get(m, 0), -len(modules[m])))
    items[:] = [item for module in order for item in modules[module]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers by rule, not by hand, over every collected test (tests/ and
    integration_tests/): `subprocess` where the test's module starts processes,
    `multirank` where it launches several ranks (`./dev.sh test-fast` leaves both out,
    and `slow`). On an xdist worker, the longest modules first."""
    sources: dict[Path, str] = {}
    for item in items:
        path = Path(item.path)
        if path not in sources:
            sources[path] = path.read_text()
        if any(word in sources[path] for word in _STARTS_PROCESSES):
            item.add_marker(pytest.mark.subprocess)
        if any(word in sources[path] for word in _STARTS_RANKS):
            item.add_marker(pytest.mark.multirank)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _longest_modules_first(items)


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
    `hardware-*.json` into their cache before they run and back after
    (`keep_measured_hardware`). One folder for all pytest-xdist workers of the run (their
    base folders' parent), so a module on one worker takes the profile another's
    measured. A test run alone measures; tests/profiling/test_measure.py tests the
    measuring itself."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "measured_hardware"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("measured_hardware")


@pytest.fixture(scope="session")
def keep_measured_hardware(measured_hardware: Path) -> Callable[[Path], None]:
    """`keep(cache)`: copy the `hardware-*.json` profiles of a test's cache into
    `measured_hardware`, each whole at once (copied under a hidden name, then renamed), so
    a test on the other xdist worker never reads half of one."""
    def keep(cache: Path) -> None:
        for profile in cache.glob("hardware-*.json"):
            part = measured_hardware / f".{profile.name}.{os.getpid()}"
            shutil.copy(profile, part)
            os.replace(part, measured_hardware / profile.name)

    return keep
