"""Engine tests run tiny models: one intra-op thread avoids spin-waiting on a shared box.

`emulated` reruns a test on the emulated async device (engine/device/emulation.py) once per seed
in `EMULATION_SEEDS`; a failing test run under the emulation (by that fixture or by
`LAZYTRAIN_EMULATE_ASYNC=1` for the whole suite) reports the seed that replays it.
"""

from __future__ import annotations

import os

import pytest
import torch

from lazytrain_accel.config import env_setting
from lazytrain_accel.engine.device.emulation import replay_hint

torch.set_num_threads(1)

#: Seeds the emulated reruns use in CI: each shakes the worker delays differently.
EMULATION_SEEDS = (0, 1, 2)


@pytest.fixture(params=EMULATION_SEEDS, ids=lambda seed: f"emulated-seed{seed}")
def emulated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run the test's engines on the emulated async device with this seed."""
    monkeypatch.setenv("LAZYTRAIN_EMULATE_ASYNC", "1")
    monkeypatch.setenv("LAZYTRAIN_EMULATE_SEED", str(request.param))
    return request.param


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed:
        seed = item.funcargs.get("emulated") if hasattr(item, "funcargs") else None
        if seed is None and os.environ.get("LAZYTRAIN_EMULATE_ASYNC"):
            seed = env_setting("emulate_seed") if env_setting("emulate_async") else None
        if seed is not None:
            report.sections.append(("emulated async device", replay_hint(seed)))
    return report
