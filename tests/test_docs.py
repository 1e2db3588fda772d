"""Every ```python, ```bash and ```sh block in docs/*.md runs, in the order written.

Python blocks of one page share a namespace (a page reads like one session); shell blocks
run with `bash -euo pipefail`. Each page runs in its own temporary directory with its own
LazyTrain cache, so pages cannot lean on each other or on the developer's machine (but for
this machine's measured hardware profile: `measured_hardware`). A block that is not meant to
run (output, a transcript, a fragment) takes another language tag: ```text, ```console,
```yaml.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
RUN_LANGUAGES = {"python": "python", "bash": "shell", "sh": "shell"}
#: A hang guard, not a timing check: the getting-started block runs the demo, which took
#: 90-118 s on a loaded 2-core machine.
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def runnable_blocks(text: str) -> list[tuple[str, int, str]]:
    """(kind, line number, code) of the blocks to run, in page order."""
    blocks = []
    for match in _FENCE.finditer(text):
        kind = RUN_LANGUAGES.get(match.group(1).lower())
        if kind is not None:
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((kind, line, match.group(2)))
    return blocks


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if runnable_blocks(p.read_text()))


def test_fence_parser_finds_only_runnable_blocks() -> None:
    page = "x\n```python\nprint(1)\n```\n```text\nno\n```\n```bash\necho hi\n```\n"
    assert runnable_blocks(page) == [("python", 2, "print(1)\n"), ("shell", 8, "echo hi\n")]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_doc_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        measured_hardware: Path,
                        keep_measured_hardware: Callable[[Path], None]) -> None:
    monkeypatch.chdir(tmp_path)
    for folder in ("examples", "bench"):  # docs run commands from the repository root
        (tmp_path / folder).symlink_to(DOCS.parent / folder)
    cache = tmp_path / "cache"
    cache.mkdir()
    for profile in measured_hardware.glob("hardware-*.json"):
        shutil.copy(profile, cache)
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(cache))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for kind, line, code in runnable_blocks(page.read_text()):
        where = f"{page.name}:{line}"
        if kind == "python":
            exec(compile(code, where, "exec"), namespace)
            continue
        bin_dir = str(Path(sys.executable).parent)  # the `lazytrain` of this interpreter
        env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], env=env,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        assert done.returncode == 0, (f"{where} exited {done.returncode}\n{done.stdout[-2000:]}"
                                      f"\n{done.stderr[-2000:]}")
    keep_measured_hardware(cache)


def _layout_section() -> str:
    text = (DOCS / "architecture.md").read_text()
    return text[text.index("## The layout"):text.index("## Import rules")]


def test_the_architecture_map_names_every_folder_and_only_files_that_exist() -> None:
    """docs/architecture.md's map stays true: a paragraph names each folder of the
    package (and each of the engine's sub-packages), and each `*.py` it names exists."""
    package = DOCS.parent / "lazytrain_accel"
    section = _layout_section()
    folders = [p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    folders += [p for p in (package / "engine").iterdir() if (p / "__init__.py").exists()]
    unnamed = [str(p.relative_to(package)) for p in folders if f"`{p.name}/`" not in section]
    assert not unnamed, f"docs/architecture.md's map has no paragraph for {unnamed}"
    files = {str(p.relative_to(package)) for p in package.rglob("*.py")}
    named = {n for n in re.findall(r"`([\w/]+\.py)", section) if not n.startswith("tests/")}
    missing = [n for n in named if not any(f == n or f.endswith("/" + n) for f in files)]
    assert not missing, f"docs/architecture.md's map names files that do not exist: {missing}"
