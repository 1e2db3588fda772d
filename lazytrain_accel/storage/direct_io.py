"""Files read and written past the page cache (`O_DIRECT`) by a few threads with several
requests in flight: the one direct-I/O module of the engine's state, the boundaries and
the checkpoints (`checkpoints/direct.py` builds on its primitives).

`O_DIRECT` wants the buffer's address, each request's length and its file offset aligned
to `BLOCK_BYTES`: a file is moved in chunks of the pool's buffer size at aligned offsets,
through page-aligned pool buffers (or straight from a tensor whose bytes are aligned);
the last block is padded and the file truncated to its exact length, so a tail that is
not a whole block survives. Where the file system refuses `O_DIRECT` (tmpfs, some FUSE)
the same requests go through the page cache. Memory: the pool, `AlignedBufferPool.
total_bytes`, whatever the files' sizes. An `OSError` reaches the caller as a
`StateIOError` naming the file and what to do; a failed write leaves no file behind.
Design: docs/architecture.md "Direct I/O"; figures: docs/benchmarks.md "Direct I/O".
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

#: The alignment `O_DIRECT` needs on Linux block devices (a 512-byte sector device
#: accepts it too).
BLOCK_BYTES = 4096
#: Bytes per request: 1 MiB reaches the same rate but costs more CPU per GB (per-request
#: overhead), docs/benchmarks.md "Direct I/O".
CHUNK_BYTES = 4 << 20
#: Threads, and so requests in flight: the cores are shared with the training and the
#: update, and two requests in flight already reach the disk's rate there.
DEFAULT_WORKERS = 2
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: buffered
_NO_ROOM = "free space on that drive (nvme_dir) or lower nvme_limit_gb"
_REMEDIES = {
    errno.ENOSPC: _NO_ROOM,
    errno.EDQUOT: _NO_ROOM,
    errno.EIO: "check the drive: the kernel log (dmesg) names the failing device",
    errno.EACCES: "check that this user may write the directory",
    errno.EROFS: "the drive is read-only: choose another directory",
    errno.ENOENT: "check that the directory exists",
}


@dataclass(frozen=True)
class FileRange:
    """Where a tensor's bytes lie in a file: a layer's state file on NVMe
    (`NvmeMasters.file_range`), which a checkpoint copies file to file."""

    path: Path
    offset_bytes: int
    nbytes: int
    dtype: torch.dtype


class StateIOError(OSError):
    """An `OSError` of a direct read or write, with the file, the operation, errno's text
    and what to do in its message."""

    def __init__(self, err: OSError, *, path: Path, operation: str) -> None:
        number = err.errno or errno.EIO
        text = os.strerror(number)
        if err.strerror and err.strerror != text:  # a detail the errno's text lacks
            text += f" ({err.strerror})"
        remedy = _REMEDIES.get(number, "check the drive and the directory")
        super().__init__(number, f"{operation} of {path} failed: {text}; {remedy}")
        self.path = path


class AlignedBuffer:
    """`size_bytes` (a positive multiple of `BLOCK_BYTES`) of page-aligned, zeroed
    memory, seen as a memoryview (`view`), a uint8 tensor (`tensor`) and an address."""

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0 or size_bytes % BLOCK_BYTES:
            raise ValueError(f"size_bytes={size_bytes} must be a positive multiple of "
                             f"{BLOCK_BYTES}")
        self._map = mmap.mmap(-1, size_bytes)  # anonymous: page-aligned, zeroed
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()


class AlignedBufferPool:
    """`count` aligned buffers of `buffer_bytes` each; `acquire` blocks while all are out,
    so the pool's memory is bounded by `total_bytes` (what the host model counts)."""

    def __init__(self, buffer_bytes: int, count: int) -> None:
        if count < 1:
            raise ValueError(f"count={count}: a pool needs at least one buffer")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self._free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(AlignedBuffer(buffer_bytes))

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes * self.count

    def acquire(self, timeout_s: float | None = None) -> AlignedBuffer:
        """A free buffer, waiting up to `timeout_s` (None: for ever) for one to return."""
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"all {self.count} buffers of {self.buffer_bytes} bytes "
                               f"stayed out for {timeout_s} s: release each buffer "
                               "acquired, or make the pool larger") from None

    def release(self, buffer: AlignedBuffer) -> None:
        self._free.put(buffer)

    @contextlib.contextmanager
    def buffer(self, timeout_s: float | None = None) -> Iterator[AlignedBuffer]:
        """A buffer for the `with` block, released after it."""
        taken = self.acquire(timeout_s)
        try:
            yield taken
        finally:
            self.release(taken)


def open_direct(path: Path, flags: int, mode: int = 0o666) -> int:
    """A descriptor of `path` opened with `flags | O_DIRECT`, or without `O_DIRECT` where
    the file system refuses it (EINVAL: tmpfs, some FUSE)."""
    try:
        return os.open(path, flags | _O_DIRECT, mode)
    except OSError as err:
        if err.errno != errno.EINVAL or not _O_DIRECT:
            raise
        return os.open(path, flags, mode)


def is_direct(fd: int) -> bool:
    """Whether `fd`'s reads and writes bypass the page cache."""
    return bool(_O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)


def _stop_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def write_all(fd: int, data: memoryview, offset_bytes: int) -> None:
    """`pwrite(2)` all of `data` at `offset_bytes`. A file system that opened `O_DIRECT`
    but refuses its writes (EINVAL) gets this and later writes through the page cache."""
    done = 0
    while done < len(data):
        try:
            done += os.pwrite(fd, data[done:], offset_bytes + done)
        except OSError as err:
            if err.errno != errno.EINVAL or not is_direct(fd):
                raise
            _stop_direct(fd)


def read_all(fd: int, data: memoryview, offset_bytes: int,
             size_bytes: int | None = None) -> int:
    """`preadv(2)` into `data` from `offset_bytes` until `size_bytes` (default: all of
    `data`; a padded last block may ask for less) are in or the file ends; the bytes
    read. EINVAL under `O_DIRECT` falls back as `write_all` does."""
    wanted = len(data) if size_bytes is None else size_bytes
    done = 0
    while done < wanted:
        try:
            got = os.preadv(fd, [data[done:]], offset_bytes + done)
        except OSError as err:
            if err.errno != errno.EINVAL or not is_direct(fd):
                raise
            _stop_direct(fd)
            continue
        if got == 0:
            break
        done += got
    return done


def _raw_view(address: int, size_bytes: int) -> memoryview:
    """The `size_bytes` of memory at `address` (a live tensor's), writable, not copied."""
    return memoryview((ctypes.c_char * size_bytes).from_address(address)).cast("B")


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """Where each tensor's bytes lie in a file that holds them back to back."""

    addresses: tuple[int, ...]
    starts_bytes: tuple[int, ...]  # each tensor's first byte in the file
    sizes_bytes: tuple[int, ...]
    total_bytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> _Layout:
        for i, t in enumerate(tensors):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"tensor {i} ({t.device}, stride {t.stride()}): direct "
                                 "I/O moves contiguous CPU tensors; pass .contiguous().cpu()")
        sizes = tuple(t.numel() * t.element_size() for t in tensors)
        starts = tuple(itertools.accumulate(sizes, initial=0))[:-1]
        return cls(addresses=tuple(t.data_ptr() for t in tensors), starts_bytes=starts,
                   sizes_bytes=sizes, total_bytes=sum(sizes))

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(memory address, offset from `start`, length) of the file's bytes [start, end)."""
        i = bisect.bisect_right(self.starts_bytes, start) - 1
        at = start
        while at < end:
            stop = min(end, self.starts_bytes[i] + self.sizes_bytes[i])
            if stop > at:
                yield self.addresses[i] + at - self.starts_bytes[i], at - start, stop - at
                at = stop
            i += 1

    def aligned_run(self, start: int, end: int) -> memoryview | None:
        """The tensor memory of [start, end) where one tensor holds it all at an aligned
        address and the length is whole blocks: moved without a copy."""
        pieces = list(self.pieces(start, end))
        if len(pieces) != 1 or pieces[0][0] % BLOCK_BYTES or (end - start) % BLOCK_BYTES:
            return None
        return _raw_view(pieces[0][0], end - start)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D tensor of `numel` `dtype` values whose bytes start at a
    `BLOCK_BYTES`-aligned address: direct I/O moves its whole blocks straight from and into
    it, without a bounce buffer's copy (`_Layout.aligned_run`)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + BLOCK_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % BLOCK_BYTES
    return raw[skip:skip + nbytes].view(dtype)


class _Transfer:
    """One file's chunks in flight: the last chunk to end closes the file and settles
    `future` (a failed write's file removed)."""

    def __init__(self, *, path: Path, writing: bool, fd: int, layout: _Layout,
                 tensors: Sequence[torch.Tensor], chunks: int, durable: bool) -> None:
        self.path, self.writing, self.fd, self.layout = path, writing, fd, layout
        self.tensors = tensors  # alive while workers move their memory by address
        self.durable = durable
        self.future: Future[None] = Future()
        self.error: Exception | None = None
        self._pending = chunks
        self._lock = threading.Lock()

    def chunk_done(self, error: Exception | None) -> None:
        with self._lock:
            self.error = self.error or error
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.finish()

    def finish(self) -> None:
        error = self.error
        try:
            if error is None and self.writing:
                os.ftruncate(self.fd, self.layout.total_bytes)  # the last block's padding
                if self.durable:
                    os.fsync(self.fd)
        except OSError as err:
            error = err
        try:
            os.close(self.fd)
        except OSError as err:  # e.g. a network file system's deferred write error
            error = error or err
        if error is not None and self.writing:
            with contextlib.suppress(OSError):  # the write's own error is the one to tell
                self.path.unlink(missing_ok=True)
        self.tensors = ()
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(_as_state_error(error, self.path, self.writing))


def _as_state_error(error: Exception, path: Path, writing: bool) -> Exception:
    if isinstance(error, OSError) and not isinstance(error, StateIOError):
        return StateIOError(error, path=path, operation="write" if writing else "read")
    return error


def _padded(size_bytes: int) -> int:
    return size_bytes + -size_bytes % BLOCK_BYTES


class DirectIO:
    """`workers` threads that read and write whole files of tensors in chunks of the
    pool's buffer size, several chunks of one file in flight at once. A pool shared with
    other users bounds the memory of all of them together."""

    def __init__(self, workers: int = DEFAULT_WORKERS, *,
                 pool: AlignedBufferPool | None = None,
                 pace: Callable[[str, int], contextlib.AbstractContextManager[None]]
                 | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: direct I/O needs at least one thread")
        self.pool = pool or AlignedBufferPool(CHUNK_BYTES, workers)
        #: brackets each chunk's transfer with its link ("nvme_read", "nvme_write") and
        #: bytes: an emulated device's drive throttles there (`EmulatedStreams.io_link`)
        self._pace = pace
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="lazytrain-direct-io")
        self._closed = False

    def write_tensors(self, path: Path, tensors: Sequence[torch.Tensor], *,
                      durable: bool = False) -> Future[None]:
        """Write the bytes of `tensors` back to back into `path` (created or truncated);
        `durable` fsyncs it. The tensors must not change until the future is done."""
        return self._start(Path(path), tensors, writing=True, durable=durable)

    def read_tensors(self, path: Path, tensors: Sequence[torch.Tensor]) -> Future[None]:
        """Fill `tensors` from a file `write_tensors` wrote for tensors of their sizes; a
        file of another length fails the future with a `ValueError`."""
        return self._start(Path(path), tensors, writing=False, durable=False)

    def remove(self, path: Path) -> None:
        """Delete `path` if it exists."""
        try:
            Path(path).unlink(missing_ok=True)
        except OSError as err:
            raise StateIOError(err, path=Path(path), operation="remove") from err

    def close(self) -> None:
        """Finish the queued work, then end the threads."""
        self._closed = True
        self._executor.shutdown(wait=True)

    def __enter__(self) -> DirectIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, path: Path, tensors: Sequence[torch.Tensor], *, writing: bool,
               durable: bool) -> Future[None]:
        if self._closed:
            raise RuntimeError(f"DirectIO is closed: {path} was not "
                               f"{'written' if writing else 'read'}")
        layout = _Layout.of(tensors)
        try:
            fd = _open_for(path, layout, writing=writing)
        except (OSError, ValueError) as err:
            failed: Future[None] = Future()
            failed.set_exception(_as_state_error(err, path, writing))
            return failed
        chunk_bytes = self.pool.buffer_bytes
        starts = range(0, layout.total_bytes, chunk_bytes)
        transfer = _Transfer(path=path, writing=writing, fd=fd, layout=layout,
                             tensors=tuple(tensors), chunks=len(starts), durable=durable)
        if not starts:
            transfer.finish()
        for start in starts:
            self._executor.submit(self._run_chunk, transfer, start)
        return transfer.future

    def _run_chunk(self, transfer: _Transfer, start: int) -> None:
        error = None
        try:
            if transfer.error is None:  # after one chunk failed the rest is moot
                end = min(start + self.pool.buffer_bytes, transfer.layout.total_bytes)
                move = _write_chunk if transfer.writing else _read_chunk
                link = "nvme_write" if transfer.writing else "nvme_read"
                with contextlib.nullcontext() if self._pace is None \
                        else self._pace(link, end - start):
                    move(transfer, start, end, self.pool)
        except Exception as err:  # settled on the future, whatever it was
            error = err
        transfer.chunk_done(error)


def _open_for(path: Path, layout: _Layout, *, writing: bool) -> int:
    if writing:
        return open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    fd = open_direct(path, os.O_RDONLY)
    size_bytes = os.fstat(fd).st_size
    if size_bytes != layout.total_bytes:
        os.close(fd)
        raise ValueError(f"{path} holds {size_bytes} bytes, the tensors to fill "
                         f"{layout.total_bytes}: it was written for other tensors or cut "
                         "short; write it again")
    return fd


def _direct_part(layout: _Layout, start: int, end: int) -> tuple[memoryview | None, int]:
    """The tensor memory of [start, end)'s whole blocks where one aligned tensor holds
    them (moved without a copy, from `start`), and where the bytes left for a bounce
    buffer begin: so a file's last chunk sends only its sub-block tail through the
    buffer, whose other pages are never touched (never resident)."""
    whole_end = start + (end - start) // BLOCK_BYTES * BLOCK_BYTES
    run = layout.aligned_run(start, whole_end) if whole_end > start else None
    return run, (whole_end if run is not None else start)


def _write_chunk(transfer: _Transfer, start: int, end: int, pool: AlignedBufferPool) -> None:
    run, rest = _direct_part(transfer.layout, start, end)
    if run is not None:
        write_all(transfer.fd, run, start)
    start = rest
    if start == end:
        return
    with pool.buffer() as buffer:
        for address, offset, size in transfer.layout.pieces(start, end):
            ctypes.memmove(buffer.address + offset, address, size)  # without the GIL
        size = end - start
        ctypes.memset(buffer.address + size, 0, _padded(size) - size)
        write_all(transfer.fd, buffer.view[:_padded(size)], start)


def _read_chunk(transfer: _Transfer, start: int, end: int, pool: AlignedBufferPool) -> None:
    run, rest = _direct_part(transfer.layout, start, end)
    if run is not None:
        _check_read(transfer, start, read_all(transfer.fd, run, start), rest)
    start = rest
    if start == end:
        return
    with pool.buffer() as buffer:
        got = read_all(transfer.fd, buffer.view[:_padded(end - start)], start, end - start)
        _check_read(transfer, start, got, end)
        for address, offset, size in transfer.layout.pieces(start, end):
            ctypes.memmove(address, buffer.address + offset, size)


def _check_read(transfer: _Transfer, start: int, got_bytes: int, end: int) -> None:
    if start + got_bytes < end:
        raise ValueError(f"{transfer.path} ended at byte {start + got_bytes} of "
                         f"{transfer.layout.total_bytes}: it was cut short while read")
