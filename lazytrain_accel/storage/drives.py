"""The NVMe directories of a run: `nvme_dir` names one directory per drive.

`nvme_dir="/mnt/nvme0/lt,/mnt/nvme1/lt"` (or a list in Python) spreads the run's files over
two drives: the files of decoder layer (or boundary) `j` go to directory `j % D`, so the
layer-ahead reads and write-behinds of neighbouring layers keep every drive busy. A RAID-0
mount is one directory (the kernel stripes it). Directories on one file system share its
drive: `drive_groups` tells them apart by device number, which the profile counts
(`HardwareProfile.nvme_drives`). Docs: docs/user_guide.md "When the state is larger than
RAM".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

#: What separates the directories in one `nvme_dir` string (`LAZYTRAIN_NVME_DIR`).
DIR_SEPARATOR = ","


def join_dirs(dirs: Sequence[str]) -> str:
    """One `nvme_dir` string of `dirs` (each expanded, in order, no repeats)."""
    seen: list[str] = []
    for d in dirs:
        path = os.path.expanduser(str(d).strip())
        if not path:
            raise ValueError("an entry is empty: name one directory per drive")
        if DIR_SEPARATOR in path:
            raise ValueError(f"entry {path!r} holds {DIR_SEPARATOR!r}, which separates the "
                             "directories of several drives: rename it")
        if path not in seen:
            seen.append(path)
    if not seen:
        raise ValueError("no directory named")
    return DIR_SEPARATOR.join(seen)


def split_dirs(nvme_dir: str) -> list[Path]:
    """The directories `nvme_dir` names, in order (one per drive)."""
    return [Path(d) for d in join_dirs(nvme_dir.split(DIR_SEPARATOR)).split(DIR_SEPARATOR)]


def _device_of(path: Path) -> int:
    """The device number of the file system `path` is (or would be created) on."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"no part of {str(path)!r} exists")


def drive_groups(dirs: Sequence[Path]) -> list[list[Path]]:
    """`dirs` grouped by the file system each lies on, in first-seen order: one group per
    drive (or RAID mount) the run's files reach."""
    groups: dict[int, list[Path]] = {}
    for path in dirs:
        groups.setdefault(_device_of(path), []).append(path)
    return list(groups.values())


def drive_of(index: int, num_dirs: int) -> int:
    """The directory (of `num_dirs`) that layer or boundary `index`'s files go to: the one
    rule the engine's files (`LayerFiles`, `NvmeSpill`) and preflight's shares follow."""
    return index % num_dirs


def layer_shares(num_layers: int, num_dirs: int) -> list[float]:
    """The fraction of `num_layers` equal layers' files (numbered from 1) each of
    `num_dirs` directories gets (`drive_of`)."""
    if num_layers <= 0:
        return [1.0] * num_dirs
    counts = [0] * num_dirs
    for j in range(1, num_layers + 1):
        counts[drive_of(j, num_dirs)] += 1
    return [count / num_layers for count in counts]
