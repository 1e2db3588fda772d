"""Integration tests launch real processes; keep their caches and NVMe files in tmp dirs."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _hermetic_lazytrain_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path / "lazytrain_cache"))
    monkeypatch.setenv("LAZYTRAIN_NVME_DIR", str(tmp_path / "lazytrain_nvme"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
