"""Checkpoint files written past the page cache through one staging buffer
(`checkpoints/direct.py`): the bytes and the length of each file are exactly those
appended, whatever the lengths and however the files interleave."""

from __future__ import annotations

import errno
import fcntl
import os
import random
from pathlib import Path

import numpy as np
import pytest

from lazytrain_accel.checkpoints import direct
from lazytrain_accel.checkpoints.direct import BLOCK_BYTES, DirectFile, Staging


def test_interleaved_files_hold_exactly_what_was_appended(tmp_path: Path) -> None:
    rng = random.Random(0)
    staging = Staging(2 * BLOCK_BYTES)  # small: fills, spills and hands over often
    lengths = [0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 7,
               5 * BLOCK_BYTES, 17, 20_000]
    expected = {name: bytearray() for name in ("a", "b", "c")}
    files = {name: DirectFile(tmp_path / name, staging) for name in expected}
    for _ in range(60):
        name = rng.choice(sorted(files))
        data = np.frombuffer(rng.randbytes(rng.choice(lengths)), dtype=np.uint8).copy()
        files[name].write(memoryview(data))
        expected[name] += data.tobytes()
        data[:] = 0  # the caller's buffer may change once write returns
    for f in files.values():
        f.finish()
        f.fsync()
        f.close()
    for name, content in expected.items():
        assert (tmp_path / name).read_bytes() == bytes(content), name


def test_an_empty_file_stays_empty(tmp_path: Path) -> None:
    with DirectFile(tmp_path / "empty", Staging()) as f:
        f.write(b"")
        f.finish()
    assert (tmp_path / "empty").stat().st_size == 0


def test_a_file_system_refusing_direct_writes_gets_them_buffered(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A file system that opens `O_DIRECT` but refuses its writes (EINVAL): the file goes
    on through the page cache, its bytes exact."""
    f = DirectFile(tmp_path / "f", Staging(2 * BLOCK_BYTES))
    if not f.direct:
        f.close()
        pytest.skip("this file system takes no O_DIRECT: nothing to refuse")
    stock_pwrite = os.pwrite

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return stock_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", refusing)
    data = random.Random(1).randbytes(5 * BLOCK_BYTES + 3)
    f.write(data)
    f.finish()
    assert not f.direct
    f.close()
    assert (tmp_path / "f").read_bytes() == data
