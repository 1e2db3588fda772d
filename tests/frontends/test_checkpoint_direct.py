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
    _assert_files_hold(tmp_path, files, expected)


def _assert_files_hold(folder: Path, files: dict[str, DirectFile],
                       expected: dict[str, bytearray]) -> None:
    """Finish and close `files`, then check each holds exactly its `expected` bytes."""
    for f in files.values():
        f.finish()
        f.fsync()
        f.close()
    for name, content in expected.items():
        assert (folder / name).read_bytes() == bytes(content), name


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


@pytest.mark.parametrize("kernel_copy", ["copy_file_range", "sendfile"])
def test_ranges_copied_file_to_file_interleave_with_writes_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_copy: str) -> None:
    """`copy_from` (issue 44 item 4): ranges of a source file appended among writes, at any
    offset and length, hold exactly the source's bytes; the kernel copies every whole block
    between the target's block boundaries (`copy_file_range(2)`, or `sendfile(2)` where the
    file systems refuse it), only the ends (under a block each) pass through the staging
    buffer."""
    rng = random.Random(1)
    source_bytes = rng.randbytes(40 * BLOCK_BYTES)
    (tmp_path / "source").write_bytes(source_bytes)
    kernel: list[tuple[int, int]] = []  # (target offset, bytes) of each kernel copy
    stock = os.copy_file_range

    def copy_file_range(src: int, dst: int, count: int, offset_src: int, offset_dst: int
                        ) -> int:
        if kernel_copy == "sendfile":
            raise OSError(errno.EXDEV, "cross-device")
        kernel.append((offset_dst, count))
        return stock(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(direct.os, "copy_file_range", copy_file_range)
    staging = Staging(2 * BLOCK_BYTES)
    expected = {name: bytearray() for name in ("a", "b")}
    files = {name: DirectFile(tmp_path / name, staging) for name in expected}
    source = os.open(tmp_path / "source", os.O_RDONLY)
    copied = 0
    try:
        for _ in range(40):
            name = rng.choice(sorted(files))
            if rng.random() < 0.5:
                data = rng.randbytes(rng.choice([0, 5, BLOCK_BYTES - 3, 2 * BLOCK_BYTES + 9]))
                files[name].write(data)
                expected[name] += data
                continue
            offset = rng.randrange(0, 20 * BLOCK_BYTES)
            nbytes = rng.choice([1, BLOCK_BYTES, 3 * BLOCK_BYTES + 11, 9 * BLOCK_BYTES + 1])
            assert files[name].copy_from(source, offset, nbytes) == nbytes
            expected[name] += source_bytes[offset:offset + nbytes]
            copied += nbytes
    finally:
        os.close(source)
    _assert_files_hold(tmp_path, files, expected)
    if kernel_copy == "copy_file_range":
        assert all(at % BLOCK_BYTES == 0 and n % BLOCK_BYTES == 0 for at, n in kernel)
        assert sum(n for _, n in kernel) > copied // 2  # most of it, never a byte in DRAM


def test_a_source_shorter_than_the_range_raises(tmp_path: Path) -> None:
    (tmp_path / "source").write_bytes(bytes(3 * BLOCK_BYTES))
    source = os.open(tmp_path / "source", os.O_RDONLY)
    try:
        with DirectFile(tmp_path / "a", Staging(2 * BLOCK_BYTES)) as f, \
                pytest.raises(OSError, match="shorter than the range"):
            f.copy_from(source, BLOCK_BYTES, 5 * BLOCK_BYTES)
    finally:
        os.close(source)
