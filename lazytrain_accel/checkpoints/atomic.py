"""Atomic checkpoint directories: a save is written beside its target, made durable,
then renamed into place, so a process killed mid-save leaves the previous checkpoint.

Layout next to a checkpoint `ckpt/`: `.ckpt.tmp-<pid>` while a save runs, `.ckpt.old-<pid>`
for the instant between the two renames that replace an existing checkpoint. `recover`
undoes whatever a killed save left behind; `load_state` calls it first (`recover_all` for
every checkpoint of a folder, when it resumes from the latest one there).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from lazytrain_accel.distributed.node_store import pid_alive


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it becomes `final` (replacing an
    existing one), on any error it is removed and `final` is untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        make_readable(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, final)


def _publish(tmp: Path, final: Path) -> None:
    # rename(2) cannot replace a non-empty directory: move the old one aside first. A kill
    # between the two renames leaves `.old`, which `recover` puts back.
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover(final: str | Path) -> None:
    """Restore `final` from a save killed between its renames; drop dead saves' temps."""
    final = Path(final)
    if not final.parent.is_dir():
        return
    for sibling in final.parent.glob(f".{final.name}.old-*"):
        if not final.exists():
            sibling.rename(final)
        elif not owner_alive(sibling):
            shutil.rmtree(sibling, ignore_errors=True)
    for sibling in final.parent.glob(f".{final.name}.tmp-*"):
        if not owner_alive(sibling):
            shutil.rmtree(sibling, ignore_errors=True)
    if final.exists():
        fsync_dir(final.parent)


#: What a save of `NAME` leaves beside it (`.NAME.tmp-<pid>`, `.NAME.old-<pid>`), and a
#: removal (`.NAME.gone-<pid>`).
_LEFT_BEHIND = re.compile(r"\.(.+)\.(tmp|old|gone)-\d+")


def recover_all(parent: str | Path) -> None:
    """`recover` every checkpoint in `parent` that a save left something beside, whether
    or not a later save reuses its name (automatic naming never does); finish the
    removals that were killed midway."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    names = set()
    for entry in parent.iterdir():
        if (m := _LEFT_BEHIND.fullmatch(entry.name)) is None:
            continue
        if m.group(2) != "gone":
            names.add(m.group(1))
        elif not owner_alive(entry):
            shutil.rmtree(entry, ignore_errors=True)
    for name in sorted(names):
        recover(parent / name)


def remove_directory(folder: Path) -> None:
    """Remove a checkpoint (rotation) so that a kill midway never leaves part of it under
    its name: it is renamed to `.NAME.gone-<pid>` first; `recover_all` ends the rest."""
    gone = folder.parent / f".{folder.name}.gone-{os.getpid()}"
    folder.rename(gone)
    shutil.rmtree(gone)


def owner_alive(path: Path) -> bool:
    """Whether the save that left `path` still runs. A killed saver stays a zombie until
    its parent (or init) reaps it, which a container's PID 1 may never do: dead too."""
    pid = path.name.rsplit("-", 1)[-1]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    return pid_alive(int(pid))


def make_readable(root: Path) -> None:
    """Give every file under `root` the mode a plain `open()` gives (0644 under the usual
    umask): transformers writes `model.safetensors` through a private temp file (0600),
    which other users, containers and serving processes then cannot read."""
    mode = 0o666 & ~_umask()
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), mode)


def _umask() -> int:
    """This process's umask, read without changing it (`os.umask` sets it to read it)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to the disk (rename orders nothing)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
