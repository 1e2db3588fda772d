"""The direct-I/O module (`storage/direct_io.py`): files of tensors written and read back
bit for bit whatever their lengths, a bounded buffer pool, several requests in flight, and
faults (EIO, ENOSPC, injected) that name the file and the remedy and leave no partial
file. A real full drive: test_direct_io_full_drive.py (it starts a process)."""

from __future__ import annotations

import errno
import gc
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lazytrain_accel.storage import direct_io
from lazytrain_accel.storage.direct_io import (
    BLOCK_BYTES,
    AlignedBuffer,
    AlignedBufferPool,
    DirectIO,
    StateIOError,
)

_ODD_SIZES = [1, BLOCK_BYTES - 1, BLOCK_BYTES + 1, (1 << 20) + 3]


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g, dtype=dtype)


def _file_bytes(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


@pytest.fixture
def small_io() -> DirectIO:
    """Chunks of two blocks: a file of a few KiB already has several in flight."""
    with DirectIO(workers=3, pool=AlignedBufferPool(2 * BLOCK_BYTES, 3)) as io:
        yield io


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", _ODD_SIZES)
def test_round_trip_is_bit_exact_and_keeps_the_tail(tmp_path: Path, dtype: torch.dtype,
                                                    numel: int) -> None:
    tensors = [_random(numel, dtype, seed=0), _random(3, torch.float32, seed=1)]
    with DirectIO() as io:
        io.write_tensors(tmp_path / "f", tensors).result(timeout=60)
        back = [torch.empty_like(t) for t in tensors]
        io.read_tensors(tmp_path / "f", back).result(timeout=60)
    assert (tmp_path / "f").read_bytes() == _file_bytes(tensors)  # the length exact too
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


def test_many_tensors_across_small_chunks(tmp_path: Path, small_io: DirectIO,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors that start and end inside chunks, an empty one, and a page-aligned one
    first, whose whole chunks move without a copy, in one file."""
    aligned = AlignedBuffer(4 * BLOCK_BYTES).tensor
    aligned.copy_(_random(aligned.numel(), torch.uint8, seed=5))
    tensors = [aligned] + [_random(n, torch.float32, seed=n) for n in (7, 0, 3000, 1, 9001)]
    uncopied = []
    stock_view = direct_io._raw_view
    monkeypatch.setattr(direct_io, "_raw_view",
                        lambda *args: uncopied.append(args) or stock_view(*args))
    small_io.write_tensors(tmp_path / "f", tensors).result(timeout=60)
    assert (tmp_path / "f").read_bytes() == _file_bytes(tensors)
    back = [AlignedBuffer(4 * BLOCK_BYTES).tensor] + [torch.zeros_like(t) for t in tensors[1:]]
    small_io.read_tensors(tmp_path / "f", back).result(timeout=60)
    assert all(torch.equal(t, b) for t, b in zip(tensors, back, strict=True))
    # Two whole chunks of the aligned tensor, each way. Another tensor may sit in memory at
    # its file offset's page phase by chance (the allocator decides), so count the
    # aligned ones only.
    aligned_ranges = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in (aligned, back[0])]
    assert sum(any(lo <= address < hi for lo, hi in aligned_ranges)
               for address, _ in uncopied) == 4


def test_an_empty_file_and_a_length_mismatch(tmp_path: Path, small_io: DirectIO) -> None:
    small_io.write_tensors(tmp_path / "empty", []).result(timeout=60)
    assert (tmp_path / "empty").stat().st_size == 0
    small_io.write_tensors(tmp_path / "f", [torch.ones(5)]).result(timeout=60)
    with pytest.raises(ValueError, match=r"holds 20 bytes, the tensors to fill 24"):
        small_io.read_tensors(tmp_path / "f", [torch.empty(6)]).result(timeout=60)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        small_io.write_tensors(tmp_path / "g", [torch.ones(4, 4).t()])
    small_io.remove(tmp_path / "f")
    small_io.remove(tmp_path / "f")  # gone already: nothing to do
    assert not (tmp_path / "f").exists()


def test_the_pool_is_bounded() -> None:
    pool = AlignedBufferPool(BLOCK_BYTES, 2)
    assert pool.total_bytes == 2 * BLOCK_BYTES
    first, second = pool.acquire(), pool.acquire()
    assert first.address % BLOCK_BYTES == 0 and first.tensor.numel() == BLOCK_BYTES
    with pytest.raises(TimeoutError, match="all 2 buffers"):
        pool.acquire(timeout_s=0.1)
    got: list[AlignedBuffer] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout_s=10)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: both buffers are out
    pool.release(second)
    waiter.join(timeout=10)
    assert got == [second]
    pool.release(first)


def _count_concurrent(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Wrap `os.<name>` so that each call lasts 20 ms; returns [most calls at once]."""
    stock: Callable[..., int] = getattr(direct_io.os, name)
    lock, active, most = threading.Lock(), [0], [0]

    def counted(*args: object) -> int:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.02)
        try:
            return stock(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(direct_io.os, name, counted)
    return most


def test_several_requests_in_flight(tmp_path: Path, small_io: DirectIO,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = _random(8 * 2 * BLOCK_BYTES + 5, torch.uint8, seed=2)  # 9 chunks
    writes = _count_concurrent(monkeypatch, "pwrite")
    reads = _count_concurrent(monkeypatch, "preadv")
    small_io.write_tensors(tmp_path / "f", [tensor]).result(timeout=60)
    back = torch.empty_like(tensor)
    small_io.read_tensors(tmp_path / "f", [back]).result(timeout=60)
    assert torch.equal(back, tensor)
    assert writes[0] >= 2 and reads[0] >= 2, (writes, reads)
    io_threads = [t for t in threading.enumerate() if t.name.startswith("lazytrain-direct-io")]
    assert len(io_threads) <= 3  # the workers, not a thread per request


def _failing(err: int) -> Callable[..., int]:
    def fail(*args: object) -> int:
        raise OSError(err, "injected")
    return fail


@pytest.mark.parametrize(("err", "remedy"), [(errno.EIO, "dmesg"),
                                             (errno.ENOSPC, "nvme_limit_gb")])
def test_a_failed_write_names_the_file_and_leaves_none(
        tmp_path: Path, small_io: DirectIO, monkeypatch: pytest.MonkeyPatch, err: int,
        remedy: str) -> None:
    stock = direct_io.os.pwrite
    calls = [0]

    def fail_third(fd: int, data: memoryview, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 3:  # two chunks are on the disk: a partial file to clean up
            raise OSError(err, "injected")
        return stock(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", fail_third)
    path = tmp_path / "state.bin"
    with pytest.raises(StateIOError, match=remedy) as caught:
        small_io.write_tensors(path, [torch.ones(10_000)]).result(timeout=60)
    assert caught.value.errno == err and f"write of {path} failed" in str(caught.value)
    assert not path.exists()


def test_a_failed_read_names_the_file_and_dmesg(tmp_path: Path, small_io: DirectIO,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.bin"
    small_io.write_tensors(path, [torch.ones(10_000)]).result(timeout=60)
    monkeypatch.setattr(direct_io.os, "preadv", _failing(errno.EIO))
    with pytest.raises(StateIOError, match=r"read of .*state\.bin failed: Input/output "
                                           r"error .*dmesg"):
        small_io.read_tensors(path, [torch.empty(10_000)]).result(timeout=60)
    with pytest.raises(StateIOError, match="check that the directory exists"):
        small_io.write_tensors(tmp_path / "no" / "f", [torch.ones(3)]).result(timeout=60)


def test_finished_transfers_keep_no_tensor_and_close_waits(tmp_path: Path) -> None:
    io = DirectIO()
    tensor = torch.ones(300_000)
    alive = weakref.ref(tensor)
    futures = [io.write_tensors(tmp_path / f"f{i}", [tensor]) for i in range(4)]
    io.close()  # waits for the queued writes
    assert all(f.done() and f.exception() is None for f in futures)
    del tensor, futures
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="closed"):
        io.write_tensors(tmp_path / "late", [torch.ones(1)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_aligned_empty_moves_its_whole_blocks_without_a_copy(
        tmp_path: Path, small_io: DirectIO, monkeypatch: pytest.MonkeyPatch,
        dtype: torch.dtype) -> None:
    """The state files' buffers (a layer's compute copy, its gradients) come from
    `aligned_empty`: every whole block of them skips the bounce buffer, the last chunk's
    too; only the sub-block tail goes through it (so a pool buffer's other pages are never
    touched: not resident), the bytes exact either way."""
    numel = (5 * BLOCK_BYTES + 100) // torch.empty((), dtype=dtype).element_size()
    source = direct_io.aligned_empty(numel, dtype)
    assert source.data_ptr() % BLOCK_BYTES == 0 and source.shape == (numel,)
    source.copy_(_random(numel, dtype, seed=7))
    uncopied, bounced = [], []
    stock_view, stock_move = direct_io._raw_view, direct_io.ctypes.memmove
    monkeypatch.setattr(direct_io, "_raw_view",
                        lambda *args: uncopied.append(args[1]) or stock_view(*args))
    monkeypatch.setattr(direct_io.ctypes, "memmove",
                        lambda *args: bounced.append(args[2]) or stock_move(*args))
    small_io.write_tensors(tmp_path / "f", [source]).result(timeout=60)
    back = direct_io.aligned_empty(numel, dtype)
    small_io.read_tensors(tmp_path / "f", [back]).result(timeout=60)
    assert torch.equal(source.view(torch.uint8), back.view(torch.uint8))
    assert (tmp_path / "f").read_bytes() == _file_bytes([source])
    # chunks of two blocks: two whole ones and the last's whole block, each way
    assert sorted(uncopied) == sorted([2 * BLOCK_BYTES, 2 * BLOCK_BYTES, BLOCK_BYTES] * 2)
    assert bounced == [100, 100]  # the tail, once each way
