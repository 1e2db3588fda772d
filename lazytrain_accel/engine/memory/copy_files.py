"""The compute-dtype copies of the layers whose copies the plan homes on NVMe
(`Plan.state.copies`): a file each, written behind the update that makes the copy, read
back for the layer's next load once its DRAM buffer was dropped (`WeightPool`).

Files go through the engine's `StateIO` (`state_io.py`, on `storage/direct_io.py`: past the
page cache, aligned, the tail kept) as `LayerFiles` (`layer_files.py`) into `<engine's
NVMe directory>/state`, which the engine removes with its boundary files
(`NvmeSpill.close`, and at interpreter exit). A failed write or read raises its
`StateIOError` at the next use of that layer's copy.
Docs: docs/engine.md "Host state on NVMe".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from lazytrain_accel.engine.memory.layer_files import LayerFiles
from lazytrain_accel.engine.memory.state_io import StateIO
from lazytrain_accel.engine.stats import Accounting


class NvmeCopies:
    """Files of the compute copies of `layers` (1-based) under `directories` (one per drive)."""

    def __init__(self, directories: Sequence[Path], layers: set[int], accounting: Accounting,
                 io: StateIO, *, claim_root: Callable[[], None]) -> None:
        #: The layers homed on NVMe now; a re-plan may change them (`WeightPool` reads a
        #: copy back from its file wherever it dropped the buffer, homed there or not).
        self.layers = frozenset(layers)
        self._files = LayerFiles(directories, "copy", accounting, io, claim_root=claim_root)

    def write(self, layer: int, copy: torch.Tensor) -> None:
        """Write `copy` (layer `layer`'s, contiguous) behind: it must not change until
        `wait_written(layer)` returns."""
        self._files.write(layer, [copy])

    def when_written(self, layer: int, then: Callable[[], None]) -> None:
        """Call `then()` once layer `layer`'s last write is done (`LayerFiles`)."""
        self._files.when_written(layer, then)

    def wait_written(self, layer: int) -> None:
        """Block until layer `layer`'s last write is on the drive; raise its error."""
        self._files.wait_written(layer)

    def read(self, layer: int, out: torch.Tensor) -> Future[None]:
        """Start filling `out` with layer `layer`'s copy from its file (after its write,
        waited for here); the future ends with the read."""
        return self._files.read(layer, [out])

    def close(self) -> None:
        """Wait for the writes and remove the files (the engine closes its `StateIO`)."""
        self._files.close()
