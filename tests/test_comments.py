"""Comments say what the code cannot, in few lines: a module docstring is what the module is,
its invariants and where its design doc is; `.ci/run`'s comments are one short line per
setting. The design lives in docs/, measurements in docs/benchmarks.md, history in git."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lazytrain_accel"
CI_RUN = ROOT / ".ci" / "run"
#: Lines a module docstring may take (aim for about 10).
MAX_DOCSTRING_LINES = 15
#: `.ci/run`'s comment lines, the shebang not counted, stay below this.
CI_COMMENT_LINES_BELOW = 15


def docstring_lines(source: str) -> int:
    """Lines of the module docstring of `source` (0 without one)."""
    doc = ast.get_docstring(ast.parse(source))
    return len(doc.splitlines()) if doc else 0


def comment_lines(script: str) -> list[str]:
    """The lines of a shell script whose first non-blank character is `#`, but its
    shebang."""
    lines = script.splitlines()
    return [line for i, line in enumerate(lines) if line.lstrip().startswith("#")
            and not (i == 0 and line.startswith("#!"))]


def test_the_counts_see_what_they_limit() -> None:
    long_doc = '"""' + "\n".join(f"line {i}" for i in range(16)) + '\n"""\nX = 1\n'
    assert docstring_lines(long_doc) == 16
    assert docstring_lines("X = 1  # no docstring\n") == 0
    script = "#!/usr/bin/env bash\n# one\nset -e\n  # two, indented\necho '# not one'\n"
    assert comment_lines(script) == ["# one", "  # two, indented"]


def test_every_module_docstring_is_short() -> None:
    too_long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = docstring_lines(path.read_text())
        if lines > MAX_DOCSTRING_LINES:
            too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines: {too_long}. Keep what the "
        "module is, its invariants and where its design doc is; move the design to docs/, "
        "measurements to docs/benchmarks.md, and drop history (git has it)")


def test_ci_run_comments_are_a_few_lines() -> None:
    comments = comment_lines(CI_RUN.read_text())
    assert len(comments) < CI_COMMENT_LINES_BELOW, (
        f".ci/run has {len(comments)} comment lines (fewer than {CI_COMMENT_LINES_BELOW} "
        "allowed): keep one short line per setting, the reasons and figures in "
        'docs/benchmarks.md "CI"')
