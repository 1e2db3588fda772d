"""The GPU check's pinning phase (issue 30 item 4): a shared mapping like the node store's,
page-locked in chunks by `engine/device/pinning.py` with the real `cudaHostRegister`, and the
H2D rate from it pageable (before) and pinned (after), so the preset's pageable share
(`PAGEABLE_SHARE`, MegaTrain's figure) is checked on this machine. A chunk limit below
the region's size forces several registrations. On a CPU (the dry run) there is nothing
to register: it reports the host copy rate both ways and `pinned: null`."""

from __future__ import annotations

import mmap
import time

import torch

from lazytrain_accel.engine.device.pinning import register_in_chunks
from lazytrain_accel.profiling.hardware import PAGEABLE_SHARE

_REPEATS = 5


def _h2d_bytes_per_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up
    if dst.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(_REPEATS):
        dst.copy_(src, non_blocking=True)
    if dst.is_cuda:
        torch.cuda.synchronize()
    return _REPEATS * src.numel() / (time.perf_counter() - start)


def run_phase(device: torch.device, nbytes: int, max_chunk_bytes: int) -> dict:
    """Pageable and pinned H2D rates from a `nbytes` MAP_SHARED mapping registered in
    chunks of at most `max_chunk_bytes`; the chunks' count, the measured share."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    host = torch.frombuffer(region, dtype=torch.uint8)
    host.fill_(1)  # touched: the pageable copy measures copies, not page faults
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = _h2d_bytes_per_s(host, dev)
    report = {"bytes": nbytes, "max_chunk_bytes": max_chunk_bytes,
              "h2d_pageable_bytes_per_s": pageable, "preset_pageable_share": PAGEABLE_SHARE,
              "pinned": None}
    if device.type == "cuda":
        cudart, chunks = torch.cuda.cudart(), []

        def register(address: int, size: int) -> int:
            err = int(cudart.cudaHostRegister(address, size, 1))
            if err == 0:
                chunks.append(address)
            return err

        report["pinned"] = register_in_chunks(
            host.data_ptr(), nbytes, max_chunk_bytes=max_chunk_bytes, register=register,
            unregister=cudart.cudaHostUnregister, what="the pinning check's mapping")
        report["chunks"] = len(chunks) if report["pinned"] else 0
        if report["pinned"]:
            pinned = _h2d_bytes_per_s(host, dev)
            report["h2d_pinned_bytes_per_s"] = pinned
            report["measured_pageable_share"] = pageable / pinned
            for address in chunks:
                cudart.cudaHostUnregister(address)
    del host, dev
    region.close()
    return report
