"""Page-locking a large shared host region (the node store) in chunks, or not at all.

`cudaHostRegister` of one very large region fails on real systems (a public report has it
failing at >= 512 GiB; the node store is 308 GiB for a 27B model on 8 GPUs and ~5 TB for
405B). So the region is registered in chunks of at most `max_chunk_bytes`; a chunk that
fails is retried at half the size down to `MIN_CHUNK_BYTES` (a limit on one
registration's size, not on the total), and a failure below that (the locked-memory limit,
`ulimit -l`, or a driver that refuses shared mappings) unregisters what was registered and
reports False: the caller trains from pageable memory, warned once, and plans with the
pageable copy rates (`HardwareProfile.pageable_links`). One failed registration never
ends the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("lazytrain_accel")

#: (address, nbytes) -> 0 on success, else an error code (`cudaHostRegister`'s).
Registrar = Callable[[int, int], int]
#: address -> error code (`cudaHostUnregister`'s).
Unregistrar = Callable[[int], int]

#: Below this a failed chunk is not a size limit: halving further would only multiply the
#: calls (a 5 TB store in 2 MiB chunks is millions of them).
MIN_CHUNK_BYTES = 1 << 30


def register_in_chunks(address: int, nbytes: int, *, max_chunk_bytes: int,
                       register: Registrar, unregister: Unregistrar, what: str) -> bool:
    """Register `nbytes` at `address` as chunks of at most `max_chunk_bytes` (halved on a
    failure, down to `MIN_CHUNK_BYTES`); True when all of it is registered. On a failure
    every registered chunk is unregistered again and one warning names `what`, the size
    and the error: the caller goes on unpinned."""
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes={max_chunk_bytes} must be > 0")
    chunk_bytes = max_chunk_bytes
    done: list[int] = []
    offset = 0
    while offset < nbytes:
        size = min(chunk_bytes, nbytes - offset)
        err = int(register(address + offset, size))
        if err == 0:
            done.append(address + offset)
            offset += size
            continue
        if size > MIN_CHUNK_BYTES:
            chunk_bytes = max(size // 2, MIN_CHUNK_BYTES)
            continue
        for chunk in done:
            unregister(chunk)
        logger.warning(
            "lazytrain: page-locking %s (%d bytes) failed at a chunk of %d bytes at offset %d "
            "(CUDA error %d); training from pageable memory, planned with the pageable copy "
            "rates (slower copies; raise the locked-memory limit, ulimit -l, or lower "
            "LAZYTRAIN_PIN_CHUNK_MAX_GIB)", what, nbytes, size, offset, err)
        return False
    return True
