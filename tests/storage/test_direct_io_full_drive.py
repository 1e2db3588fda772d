"""A real full drive (`storage/direct_io.py`): a 2 MiB tmpfs, mounted in a private mount
namespace by a subprocess under `unshare --mount`, given 4 MiB. tmpfs refuses `O_DIRECT`,
so this is the buffered fallback's real ENOSPC (test_direct_io.py injects it on the direct
path)."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_FULL_DRIVE = textwrap.dedent("""
    import subprocess, sys, torch
    from pathlib import Path
    from lazytrain_accel.storage.direct_io import DirectIO, StateIOError
    folder = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                   check=True)
    with DirectIO() as io:
        try:
            io.write_tensors(folder / "state.bin", [torch.ones(1 << 20)]).result(60)
        except StateIOError as err:
            print("errno", err.errno, "left", sorted(p.name for p in folder.iterdir()))
            print(err)
""")


def test_a_full_drive_says_what_to_do_and_leaves_no_file(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine")
    probe = subprocess.run(["unshare", "--mount", "--", "true"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.strip()}")
    done = subprocess.run(["unshare", "--mount", "--", sys.executable, "-c", _FULL_DRIVE,
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"errno {errno.ENOSPC} left []" in done.stdout, done.stdout
    assert "No space left on device" in done.stdout and "nvme_limit_gb" in done.stdout
