"""The kernel's build is named by everything the binary depends on, and announced once."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from lazytrain_accel.optim import native


@pytest.fixture
def source(tmp_path, monkeypatch):
    path = tmp_path / "adamw8bit.cpp"
    path.write_text("// v1\n")
    monkeypatch.setattr(native, "_SOURCE", path)
    return path


AVX2 = native.variant_named("avx2")


def test_the_build_name_changes_with_source_torch_python_abi_and_variant(source, monkeypatch):
    first = native._build_name(AVX2)
    assert first == native._build_name(AVX2)  # stable: the next run loads, not rebuilds
    assert native._build_name(native.variant_named("avx512")) != first
    source.write_text("// v2\n")
    assert native._build_name(AVX2) != first
    second = native._build_name(AVX2)
    monkeypatch.setattr(native.torch, "__version__", "9.9.9")
    assert native._build_name(AVX2) != second
    monkeypatch.undo()
    monkeypatch.setattr(native, "_SOURCE", source)
    monkeypatch.setattr(sys.implementation, "cache_tag", "cpython-399")
    assert native._build_name(AVX2) != second


def test_the_variant_is_chosen_by_the_cpu_flags_never_by_the_build_machine():
    v3 = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

    def names(flags, machine="x86_64"):
        return [v.name for v in native.runnable_variants(frozenset(flags), machine)]

    assert names(v4) == ["avx512", "avx2", "portable"]
    assert names(v4 - {"avx512bw"}) == ["avx2", "portable"]
    assert names(v3 - {"fma"}) == ["portable"]  # an old x86 CPU: SSE2 only
    assert names({"fp", "asimd"}, "aarch64") == ["neon", "portable"]
    assert names(v4, "aarch64") == ["neon", "portable"]  # x86 flags never pick x86 code
    with pytest.raises(ValueError, match="avx2"):
        native.variant_named("avx1024")


def test_a_missing_build_says_one_line_while_it_builds(source, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls = []

    def fake_load(*, name, build_directory, is_python_module, **_):
        assert not is_python_module  # the ops register themselves: no pybind module
        calls.append(build_directory)
        (tmp_path / "ext" / name / f"{name}.so").write_text("")
        return str(tmp_path / "ext" / name / f"{name}.so")

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    monkeypatch.setattr(native, "_bind", lambda variant, library: types.SimpleNamespace(
        code_constants=native._expected_constants()))
    for _ in range(2):  # two processes: neither holds a build of the variant yet
        monkeypatch.setattr(native, "_LOADED", {})
        native.load_kernel.cache_clear()
        with caplog.at_level(logging.WARNING, logger=native.logger.name):
            assert native.load_kernel() is not None
    native.load_kernel.cache_clear()
    said = [r.getMessage() for r in caplog.records if "building" in r.getMessage()]
    assert len(said) == 1 and "first use" in said[0]  # the second load found the build
    best = native.runnable_variants()[0]
    assert calls[0] == calls[1] == str(tmp_path / "ext" / native._build_name(best))


def test_a_build_lock_left_by_a_killed_build_is_removed_a_fresh_one_kept(tmp_path, caplog):
    """torch waits forever on a build lock whose builder died (Ctrl-C during the first
    build): a lock older than any build is removed, with a warning; a fresh one is another
    process building, which torch waits for."""
    lock = tmp_path / "lock"
    lock.touch()
    now = lock.stat().st_mtime
    assert not native.clear_stale_build_lock(tmp_path, now_s=now + 60)
    assert lock.exists()
    with caplog.at_level(logging.WARNING, logger=native.logger.name):
        assert native.clear_stale_build_lock(tmp_path, now_s=now + native.STALE_BUILD_LOCK_S)
    assert not lock.exists()
    assert "did not finish" in caplog.text
    assert not native.clear_stale_build_lock(tmp_path)  # no lock: nothing to do


def test_another_build_of_a_loaded_variant_is_refused_not_loaded(tmp_path, monkeypatch,
                                                                 caplog):
    """A variant's ops register once per process: loading another build of it (its
    sources changed, another TORCH_EXTENSIONS_DIR) would abort Python, so the load is
    refused before it, with the reason, and the optimizer takes the torch path."""
    best = native.runnable_variants()[0]
    monkeypatch.setattr(native, "_LOADED", {native.op_namespace(best): "/elsewhere/old.so"})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))

    def no_load(**_):
        raise AssertionError("loaded beside the other build")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_load)
    with caplog.at_level(logging.WARNING, logger=native.logger.name):
        assert native.load_kernel.__wrapped__() is None
    assert "another build" in caplog.text and "/elsewhere/old.so" in caplog.text


def test_a_failed_build_warns_once_with_the_fix_and_the_plan_prices_the_torch_path(
        tmp_path, monkeypatch, caplog):
    """The build fails for real (CXX names no compiler): one warning says how much slower
    the fallback is and what to install, however many optimizers are built, and the
    planner's host update rate becomes the torch path's, not the kernel's."""
    from lazytrain_accel.config import LazyTrainConfig
    from lazytrain_accel.optim import HybridAdamW8bit
    from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
    from lazytrain_accel.run import setup

    from .helpers import make_params

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "_LOADED", {})  # build for real, even where it is loaded
    h800 = HARDWARE_PRESETS["h800"]
    native.load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.logger.name):
            for _ in range(2):
                assert not HybridAdamW8bit(make_params()).uses_native_kernel
            planned = setup.hardware_for_backend(LazyTrainConfig(), h800)
            kept = setup.hardware_for_backend(LazyTrainConfig(optimizer="keep"), h800)
    finally:
        native.load_kernel.cache_clear()  # later tests load the real build again
    said = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(said) == 1, said
    assert "30x slower" in said[0] and "pip install ninja" in said[0] and "g++" in said[0]
    assert planned.cpu_optimizer_params_per_s == pytest.approx(
        h800.cpu_optimizer_params_per_s / native.TORCH_PATH_SLOWDOWN)
    assert "no native kernel" in planned.source
    assert kept.cpu_optimizer_params_per_s == h800.cpu_optimizer_params_per_s
