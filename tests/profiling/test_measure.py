"""`hardware="auto"`: this machine measured once, cached by machine, re-measured on demand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lazytrain_accel.profiling import measure
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.hardware_spec import load_hardware

_PROBE_BYTES = 16 * 1024**2


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[HardwareProfile, str, str]:
    cache = str(tmp_path_factory.mktemp("cache"))
    nvme = str(tmp_path_factory.mktemp("nvme"))
    profile = measure.measure_hardware(cache_dir=cache, nvme_dir=nvme, probe_bytes=_PROBE_BYTES)
    return profile, cache, nvme


def test_measured_profile_is_plausible_for_a_cpu(measured) -> None:
    profile, _, nvme = measured
    assert profile.gpu_name.startswith("cpu")
    # On a CPU "device", the GPU tier and the host tier split one RAM.
    assert profile.gpu_memory_bytes == profile.cpu_memory_bytes > 1024**3
    assert profile.achieved_flops_per_s > 1e8
    assert profile.h2d_bytes_per_s > 1e8 and profile.d2h_bytes_per_s > 1e8
    assert profile.nvme_read_bytes_per_s > 1e6 and profile.nvme_write_bytes_per_s > 1e6
    assert profile.cpu_optimizer_params_per_s > 1e6
    assert profile.dequant_bytes_per_s > 1e7  # bitsandbytes' CPU nf4 kernel, measured
    assert nvme in profile.source and "dequantize_4bit" in profile.source
    # the engine's per-layer-run overhead, measured through the engine (layer_probe.py)
    # (medians of differences: on a busy machine they move; plausibility only)
    runs_s = profile.layer_forward_overhead_s + profile.layer_backward_overhead_s
    assert 0 <= runs_s < 1.0 and 0 <= profile.step_overhead_s < 1.0
    assert "layer_probe.py" in profile.source


def test_cache_is_reused_without_measuring(measured, monkeypatch) -> None:
    profile, cache, nvme = measured

    def fail(*args, **kwargs):
        raise AssertionError("measured again although a cached profile exists")

    monkeypatch.setattr(measure, "_measure", fail)
    assert measure.measure_hardware(cache_dir=cache, nvme_dir=nvme) == profile
    assert load_hardware("auto", cache_dir=cache, nvme_dir=nvme) == profile


def test_refresh_and_corrupt_cache_measure_again(measured, monkeypatch) -> None:
    profile, cache, nvme = measured
    calls = []

    def fake(device, nvme_dir, probe_bytes):
        calls.append(nvme_dir)
        return profile

    monkeypatch.setattr(measure, "_measure", fake)
    measure.measure_hardware(cache_dir=cache, nvme_dir=nvme, refresh=True)
    assert len(calls) == 1
    (cache_file,) = Path(cache).glob("hardware-*.json")
    cache_file.write_text("{truncated")
    assert measure.measure_hardware(cache_dir=cache, nvme_dir=nvme) == profile
    assert len(calls) == 2
    assert HardwareProfile.load(cache_file) == profile  # the cache was rewritten


def test_another_nvme_dir_is_another_machine_key(measured, tmp_path, monkeypatch) -> None:
    profile, cache, _ = measured
    calls = []
    monkeypatch.setattr(measure, "_measure", lambda *a: calls.append(a) or profile)
    measure.measure_hardware(cache_dir=cache, nvme_dir=str(tmp_path))
    assert len(calls) == 1


def test_another_thread_count_is_another_machine_key(measured, monkeypatch) -> None:
    """The update rate is measured at the run's thread count: a run with other threads
    measures again instead of planning with another count's rate."""
    profile, cache, nvme = measured
    calls = []
    monkeypatch.setattr(measure, "_measure", lambda *a: calls.append(a) or profile)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        measure.measure_hardware(cache_dir=cache, nvme_dir=nvme)
    finally:
        torch.set_num_threads(threads)
    measure.measure_hardware(cache_dir=cache, nvme_dir=nvme)
    assert len(calls) == 1  # the other count measured; the run's own count is cached


def test_known_gpu_names_get_the_vendor_peak() -> None:
    assert measure._vendor_peak_flops_per_s("NVIDIA H200", 1.0) == 989.4e12
    assert measure._vendor_peak_flops_per_s("NVIDIA H100 80GB HBM3", 1.0) == 989.4e12
    assert measure._vendor_peak_flops_per_s("NVIDIA GeForce RTX 4090", 1.0) == 165.2e12
    assert measure._vendor_peak_flops_per_s("NVIDIA L4", 7.0) == 7.0


def test_the_optimizer_rate_times_the_update_the_engine_runs(monkeypatch) -> None:
    from lazytrain_accel.optim import HybridAdamW8bit

    calls = []
    original = HybridAdamW8bit.step_params

    def counted(self, params, *, out_bf16=None):
        calls.append(params[0].grad is not None)
        return original(self, params, out_bf16=out_bf16)

    monkeypatch.setattr(HybridAdamW8bit, "step_params", counted)
    assert measure._measure_optimizer(torch.device("cpu"), num_params=4096) > 0
    assert calls == [True] * 4  # one warm-up and three timed steps, each with a gradient


def _other_file_system(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm as a file system apart from the test's directory")
    import tempfile

    return Path(tempfile.mkdtemp(prefix="lazytrain-drive-", dir=shm))


def test_each_drive_is_probed_at_once_and_their_rates_summed(tmp_path, monkeypatch,
                                                             caplog) -> None:
    """`nvme_dir` naming one directory per drive: each file system probed once (two
    directories on one drive share it, and say so), all at once, the rates summed."""
    disk, same = tmp_path / "a", tmp_path / "b"
    disk.mkdir()
    same.mkdir()
    other = _other_file_system(tmp_path)
    try:
        probed = []

        def rates(directory: Path, nbytes: int) -> tuple[float, float]:
            probed.append(directory)
            return (1e9, 5e8) if directory == disk else (2e9, 1e9)

        monkeypatch.setattr(measure, "_measure_nvme", rates)
        monkeypatch.setattr(measure, "_measure_nvme_full_duplex", lambda d, n: d == disk)
        with caplog.at_level("WARNING", logger="lazytrain_accel"):
            drives = measure._measure_drives([disk, other, same], 1 << 20)
        assert sorted(probed) == sorted([disk, other])
        assert "3 directories on 2 file systems" in caplog.text
        assert (drives.count, drives.read_bytes_per_s, drives.write_bytes_per_s) == (
            2, 3e9, 1.5e9)
        assert not drives.full_duplex  # one of them shares its bandwidth
        monkeypatch.undo()
        real = measure._measure_drives([disk, other], 4 << 20)  # the probes themselves
        assert real.count == 2 and real.read_bytes_per_s > 0 and real.write_bytes_per_s > 0
        assert not list(disk.iterdir()) and not list(other.iterdir())
    finally:
        import shutil

        shutil.rmtree(other)


def test_the_drives_are_one_machine_key_in_order(measured, tmp_path, monkeypatch) -> None:
    profile, cache, nvme = measured
    calls = []
    monkeypatch.setattr(measure, "_measure", lambda *a: calls.append(a[1]) or profile)
    for dirs in (f"{nvme},{tmp_path}", f"{nvme},{tmp_path}", f"{tmp_path},{nvme}"):
        measure.measure_hardware(cache_dir=cache, nvme_dir=dirs)
    assert calls == [[Path(nvme), tmp_path], [tmp_path, Path(nvme)]]
