"""The emulated device's drift tools the re-planner's tests use: a link's rate changed
mid-run, links throttled to another profile than the plan's. Workload: bench/replan.py."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
replan = pytest.importorskip("replan")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_set_link_rate_changes_the_throttle_of_the_next_copy() -> None:
    from lazytrain_accel.engine.emulation import EmulatedStreams, EmulationSettings

    streams = EmulatedStreams(torch.device("cpu"), EmulationSettings(
        link_bytes_per_s={"h2d": 1e9}))
    try:
        streams.set_link_rate("nvme_read", 5e5)
        streams.set_link_rate("h2d", None)
        assert streams.settings.link_bytes_per_s == {"nvme_read": 5e5}
        with pytest.raises(ValueError, match="link='pcie'"):
            streams.set_link_rate("pcie", 1.0)
    finally:
        streams.close()


def test_emulate_links_json_throttles_to_that_profile(tmp_path) -> None:
    from lazytrain_accel import LazyTrainPlugin
    from lazytrain_accel.integrations.setup import emulation_for

    links = dataclasses.replace(replan.true_profile(), nvme_read_bytes_per_s=123.0)
    links.save(tmp_path / "links.json")
    config = LazyTrainPlugin(emulate_async=True, emulate_links=str(tmp_path / "links.json"))
    settings = emulation_for(config, replan.claimed_profile())
    assert settings.link_bytes_per_s["nvme_read"] == 123.0
