"""Shared fixtures: a fixed CPU hardware profile, so no test measures the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from lazytrain_accel.profiling.hardware import HardwareProfile

GIB = 2**30


def cpu_profile() -> HardwareProfile:
    """A 2-core CPU "device" with the rates `--hardware auto` measured on the dev VM."""
    return HardwareProfile(
        name="test-cpu", gpu_name="cpu (2 cores)", gpu_memory_bytes=12 * GIB,
        cpu_memory_bytes=12 * GIB, nvme_bytes=64 * GIB, peak_bf16_flops_per_s=1.8e10,
        achieved_flops_per_s=1.8e10, h2d_bytes_per_s=2.1e9, d2h_bytes_per_s=2.1e9,
        nvme_read_bytes_per_s=1.4e9, nvme_write_bytes_per_s=7e7,
        cpu_optimizer_params_per_s=3.5e8, source="tests/demo/conftest.py")


@pytest.fixture(scope="session")
def hardware_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hardware") / "hardware.json"
    cpu_profile().save(path)
    return path
