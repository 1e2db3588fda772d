"""Hardware presets, JSON round trip and `load_hardware`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from lazytrain_accel.profiling.hardware import (
    HARDWARE_PRESETS,
    HOST_MEMORY_EFFICIENCY,
    HOST_UPDATE_BYTES_PER_PARAM,
    HOST_UPDATE_TRIAD_FRACTION,
    HardwareProfile,
    host_update_params_per_s,
)
from lazytrain_accel.profiling.hardware_spec import load_hardware

_REQUIRED = {"h800", "h200", "a100-80g", "a100-40g", "rtx3090", "rtx4090"}


def test_required_presets_exist_with_sources() -> None:
    assert set(HARDWARE_PRESETS) >= _REQUIRED
    for name, hw in HARDWARE_PRESETS.items():
        assert hw.name == name
        assert "datasheet" in hw.source or "whitepaper" in hw.source
        assert hw.achieved_flops_per_s < hw.peak_bf16_flops_per_s


def test_h800_carries_the_paper_measurements() -> None:
    hw = HARDWARE_PRESETS["h800"]
    assert hw.h2d_bytes_per_s == hw.d2h_bytes_per_s == 12e9
    assert (hw.nvme_read_bytes_per_s, hw.nvme_write_bytes_per_s) == (2.83e9, 3.35e9)
    assert "2608.11919" in hw.source


# The vector ISA of each preset's host CPU (its `source` names the CPU): the variant of
# the kernel its dispatch picks there.
_HOST_ISA = {"h800": "avx512", "h200": "avx512", "a100-80g": "avx2", "a100-40g": "avx2",
             "rtx3090": "avx2", "rtx4090": "avx512"}


@pytest.mark.parametrize("name", sorted(HARDWARE_PRESETS))
def test_preset_host_update_rate_follows_from_its_host_bandwidth(name: str) -> None:
    hw, isa = HARDWARE_PRESETS[name], _HOST_ISA[name]
    fraction = HOST_UPDATE_TRIAD_FRACTION[isa]
    triad_bytes_per_s = HOST_MEMORY_EFFICIENCY * hw.host_memory_bytes_per_s
    assert hw.cpu_optimizer_params_per_s == pytest.approx(
        triad_bytes_per_s * fraction / HOST_UPDATE_BYTES_PER_PARAM)
    # its source names the three figures and where the measured one comes from
    assert f"host DRAM {hw.host_memory_bytes_per_s / 1e9:.1f} GB/s x" in hw.source
    assert f"x {fraction} (the 8-bit update's fraction of the triad, its {isa} variant" \
        in hw.source
    assert f"/ {HOST_UPDATE_BYTES_PER_PARAM} bytes a parameter" in hw.source
    assert "bench/optimizer.py" in hw.source and "docs/benchmarks.md" in hw.source


def test_h200_host_update_rate_is_the_one_the_docs_quote() -> None:
    # docs/optimizer.md and docs/benchmarks.md (the 405B re-plan) quote 21.25e9 params/s:
    # 614.4 GB/s x 0.75 x 0.83 (avx512) / 18
    assert HARDWARE_PRESETS["h200"].cpu_optimizer_params_per_s == pytest.approx(
        21.248e9, rel=1e-3)


def test_a_host_isa_without_a_measured_fraction_is_refused() -> None:
    with pytest.raises(ValueError, match=r"host_isa='sve'.*avx2"):
        host_update_params_per_s(614.4e9, "sve")


def test_gpu_memory_ordering_is_sane() -> None:
    gib = {name: hw.gpu_memory_bytes / 1024**3 for name, hw in HARDWARE_PRESETS.items()}
    assert gib["rtx3090"] < gib["a100-40g"] < gib["a100-80g"] < gib["h200"]
    assert 79 < gib["h800"] < 80


def test_save_load_round_trip(tmp_path) -> None:
    path = tmp_path / "sub" / "hw.json"
    HARDWARE_PRESETS["rtx4090"].save(path)
    assert HardwareProfile.load(path) == HARDWARE_PRESETS["rtx4090"]
    assert load_hardware(str(path)) == HARDWARE_PRESETS["rtx4090"]
    assert not list(path.parent.glob("*.tmp"))


def test_concurrent_saves_of_one_profile_path_never_take_each_others_file(
        tmp_path, errors_of_concurrent_calls) -> None:
    """The ranks of a launch measuring at once save to one cache path: each renames a
    temporary file of its own, so none fails and the file is always whole."""
    path = tmp_path / "hw.json"
    assert errors_of_concurrent_calls(lambda: HARDWARE_PRESETS["h800"].save(path)) == []
    assert HardwareProfile.load(path) == HARDWARE_PRESETS["h800"]
    assert [p.name for p in tmp_path.iterdir()] == ["hw.json"]


def test_from_dict_names_missing_and_unknown_keys() -> None:
    data = HARDWARE_PRESETS["h800"].to_dict()
    del data["h2d_bytes_per_s"]
    data["pcie_gen"] = 5
    with pytest.raises(ValueError, match=r"missing keys \['h2d_bytes_per_s'\].*\['pcie_gen'\]"):
        HardwareProfile.from_dict(data)
    with pytest.raises(ValueError, match="JSON object"):
        HardwareProfile.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "12e9", True])
def test_rates_must_be_finite_positive_numbers(bad) -> None:
    with pytest.raises(ValueError, match="h2d_bytes_per_s"):
        dataclasses.replace(HARDWARE_PRESETS["h800"], h2d_bytes_per_s=bad)


def test_load_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        HardwareProfile.load(tmp_path / "none.json")
    (tmp_path / "torn.json").write_text('{"name": ')
    with pytest.raises(ValueError, match=r"torn\.json.*not valid JSON"):
        load_hardware(str(tmp_path / "torn.json"))
    (tmp_path / "partial.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match=r"partial\.json.*missing keys"):
        load_hardware(str(tmp_path / "partial.json"))


def test_load_hardware_names_are_case_insensitive_and_checked() -> None:
    assert load_hardware(" H800 ") is HARDWARE_PRESETS["h800"]
    with pytest.raises(ValueError, match=r"hardware 'tpu-v5'.*'auto'.*h800"):
        load_hardware("tpu-v5")


def test_profiling_import_does_not_load_torch() -> None:
    """The planner and `lazytrain plan` stay quick to import because profiles are torch-free."""
    code = ("import sys, lazytrain_accel.profiling, lazytrain_accel.cli.profile_cmd; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
