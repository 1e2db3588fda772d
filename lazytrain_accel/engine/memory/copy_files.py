"""The compute-dtype copies of the layers whose copies the plan homes on NVMe
(`Plan.state.copies`): a file each, written behind the update that makes the copy, read
back for the layer's next load once its DRAM buffer was dropped (`WeightPool`).

Files go through the engine's `StateIO` (`state_io.py`, on `storage/direct_io.py`: past the
page cache, aligned, the tail kept) into `<engine's NVMe directory>/state`, which the engine removes
with its boundary files (`NvmeSpill.close`, and at interpreter exit). A failed write or
read raises its `StateIOError` at the next use of that layer's copy.
Docs: docs/engine.md "Host state on NVMe".
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from lazytrain_accel.engine.memory.state_io import StateIO
from lazytrain_accel.engine.stats import Accounting


class NvmeCopies:
    """Files of the compute copies of `layers` (1-based) under `directory`."""

    def __init__(self, directory: Path, layers: set[int], accounting: Accounting,
                 io: StateIO, *, claim_root: Callable[[], None]) -> None:
        #: The layers homed on NVMe now; a re-plan may change them (`WeightPool` reads a
        #: copy back from its file wherever it dropped the buffer, homed there or not).
        self.layers = frozenset(layers)
        self._directory = directory
        self._claim_root = claim_root
        self._acct = accounting
        self._io = io
        self._writes: dict[int, Future[None]] = {}
        self._sizes: dict[int, int] = {}

    def _path(self, layer: int) -> Path:
        return self._directory / f"copy-{layer}.bin"

    def write(self, layer: int, copy: torch.Tensor) -> None:
        """Write `copy` (layer `layer`'s, contiguous) behind: it must not change until
        `wait_written(layer)` returns."""
        self.wait_written(layer)  # the previous write of this file, whole
        self._claim_root()  # the engine's directory, locked (`NvmeSpill.claim`)
        self._directory.mkdir(exist_ok=True)
        nbytes = copy.numel() * copy.element_size()
        if layer not in self._sizes:
            self._acct.allocate("nvme", nbytes)
            self._sizes[layer] = nbytes
        self._writes[layer] = self._io.write(self._path(layer), [copy])

    def when_written(self, layer: int, then: Callable[[], None]) -> None:
        """Call `then()` once layer `layer`'s last write is done (now, if none runs; else
        on the I/O thread that ends it, whether it failed or not: the error is raised at
        the file's next use)."""
        write = self._writes.get(layer)
        if write is None:
            then()
        else:
            write.add_done_callback(lambda _: then())

    def wait_written(self, layer: int) -> None:
        """Block until layer `layer`'s last write is on the drive; raise its error."""
        write = self._writes.pop(layer, None)
        if write is not None:
            write.result()

    def read(self, layer: int, out: torch.Tensor) -> Future[None]:
        """Start filling `out` with layer `layer`'s copy from its file (after its write,
        waited for here); the future ends with the read."""
        self.wait_written(layer)
        return self._io.read(self._path(layer), [out])

    def close(self) -> None:
        """Wait for the writes and remove the files (the engine closes its `StateIO`)."""
        try:
            for layer in list(self._writes):
                self.wait_written(layer)
        finally:
            for layer, nbytes in self._sizes.items():
                self._path(layer).unlink(missing_ok=True)
                self._acct.free("nvme", nbytes)
            self._sizes = {}
