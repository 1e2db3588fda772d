"""One file per decoder layer of a part of the host state (`<prefix>-<j>.bin`), the keeper
that the compute copies (`copy_files.py`) and the gradients (`grad_files.py`) on NVMe
share: writes behind through the engine's `StateIO` (a file's next write or read waits
for its last write), its NVMe bytes counted, the files removed at `close`.

The directories are `<engine's NVMe directory>/state` on each drive (`NvmeSpill.state_dirs`:
layer `j`'s file on drive `j % D`), made at the first write once the engine's own
directories are claimed (`claim_root`: `NvmeSpill.claim`, locked for the process's life).
A failed write or read raises its `StateIOError` at the file's next use.
Docs: docs/engine.md "Host state on NVMe".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from lazytrain_accel.engine.memory.state_io import StateIO
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.storage.drives import drive_of


class LayerFiles:
    """Files `<prefix>-<layer>.bin`, layer `j`'s under `directories[j % len(directories)]`."""

    def __init__(self, directories: Sequence[Path], prefix: str, accounting: Accounting,
                 io: StateIO, *, claim_root: Callable[[], None]) -> None:
        self._directories = list(directories)
        self._prefix = prefix
        self._claim_root = claim_root
        self._acct = accounting
        self._io = io
        self._sizes: dict[int, int] = {}  # each file's bytes, counted on NVMe: its largest
        #: layer -> its last write (the tensors it writes stay alive until it is done)
        self._writes: dict[int, Future[None]] = {}

    def _drive(self, layer: int) -> int:
        return drive_of(layer, len(self._directories))

    def path(self, layer: int) -> Path:
        return self._directories[self._drive(layer)] / f"{self._prefix}-{layer}.bin"

    def write(self, layer: int, tensors: Sequence[torch.Tensor]) -> Future[None]:
        """Write `tensors` (contiguous) to layer `layer`'s file behind, after its previous
        write: they must not change until the returned future is done."""
        self.wait_written(layer)
        self._claim_root()
        self.path(layer).parent.mkdir(exist_ok=True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > self._sizes.get(layer, 0):
            self._acct.allocate("nvme", nbytes - self._sizes.get(layer, 0))
            self._sizes[layer] = nbytes
        write = self._writes[layer] = self._io.write(self.path(layer), list(tensors),
                                                     drive=self._drive(layer))
        return write

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

    def read(self, layer: int, tensors: Sequence[torch.Tensor]) -> Future[None]:
        """Start filling `tensors` from layer `layer`'s file (after its last write, waited
        for here); the future ends with the read."""
        self.wait_written(layer)
        return self._io.read(self.path(layer), list(tensors), drive=self._drive(layer))

    def close(self) -> None:
        """Wait for every write, remove the files, then raise the first write's error."""
        writes, self._writes = self._writes, {}
        errors = [w.exception() for w in writes.values()]
        for layer, nbytes in self._sizes.items():
            self.path(layer).unlink(missing_ok=True)
            self._acct.free("nvme", nbytes)
        self._sizes = {}
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
