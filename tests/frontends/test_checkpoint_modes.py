"""Atomic checkpoint saves publish files with the mode a plain open() gives (0644)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lazytrain_accel.checkpoints.atomic import atomic_directory


def test_files_written_private_are_published_readable(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    final = tmp_path / "ckpt"
    with atomic_directory(final) as staging:
        # What transformers' safetensors save does: a private (0600) file.
        fd = os.open(staging / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        (staging / "sub").mkdir()
        (staging / "sub" / "optimizer.bin").write_bytes(b"x")
        os.chmod(staging / "sub" / "optimizer.bin", 0o600)
    for path in (final / "model.safetensors", final / "sub" / "optimizer.bin"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
