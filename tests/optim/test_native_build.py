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


def test_the_build_name_changes_with_source_torch_and_python_abi(source, monkeypatch):
    first = native._build_name()
    assert first == native._build_name()  # stable: the next run loads, not rebuilds
    source.write_text("// v2\n")
    assert native._build_name() != first
    second = native._build_name()
    monkeypatch.setattr(native.torch, "__version__", "9.9.9")
    assert native._build_name() != second
    monkeypatch.undo()
    monkeypatch.setattr(native, "_SOURCE", source)
    monkeypatch.setattr(sys.implementation, "cache_tag", "cpython-399")
    assert native._build_name() != second


def test_a_missing_build_says_one_line_while_it_builds(source, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls = []

    def fake_load(*, name, build_directory, **_):
        calls.append(build_directory)
        (tmp_path / "ext" / name / f"{name}.so").write_text("")
        return types.SimpleNamespace(code_constants=native._expected_constants())

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    for _ in range(2):
        native.load_kernel.cache_clear()
        with caplog.at_level(logging.WARNING, logger=native.logger.name):
            assert native.load_kernel() is not None
    native.load_kernel.cache_clear()
    said = [r.getMessage() for r in caplog.records if "building" in r.getMessage()]
    assert len(said) == 1 and "first use" in said[0]  # the second load found the build
    assert calls[0] == calls[1] == str(tmp_path / "ext" / native._build_name())


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
