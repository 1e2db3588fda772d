"""The `lazytrain` entry point: quick to start, one wording for bad values, hints for typos."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lazytrain_accel.cli import main

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "accelerate", "pyscipopt", "numpy", "matplotlib",
         "lazytrain_accel.planning")


def _imported_by(argv: list[str]) -> set[str]:
    """Modules (among HEAVY) that `lazytrain ARGV` imports, in a fresh interpreter."""
    code = ("import contextlib, io, json, sys\n"
            "from lazytrain_accel.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            f"    main({argv!r})\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_help_imports_no_subcommand() -> None:
    assert _imported_by(["--help"]) == set()
    assert _imported_by([]) == set()


def test_each_subcommand_imports_only_what_it_needs() -> None:
    assert _imported_by(["profile", "--help"]) == set()  # no planner, no torch
    assert _imported_by(["demo", "--help"]) == set()  # torch only once the demo runs
    assert "pyscipopt" in _imported_by(["plan", "--help"])


@pytest.mark.parametrize("argv", [
    ["profile", "--model", "tiny-demo", "--hardware", "h800"],
    ["plan", "--model", "tiny-demo", "--hardware", "h800", "--seq-len", "8"],
    ["simulate", "--model", "tiny-demo", "--hardware", "h800", "--seq-len", "8"],
    ["demo"],
])
def test_batch_size_zero_reads_the_same_in_every_command(argv: list[str], capsys) -> None:
    assert main([*argv, "--batch-size", "0"]) == 2
    command = argv[0]
    assert capsys.readouterr().err == (f"lazytrain {command}: argument --batch-size: 0 must be "
                                       f">= 1; see `lazytrain {command} --help`\n")


def test_typos_get_a_did_you_mean(capsys) -> None:
    assert main(["paln"]) == 2
    assert "unknown command 'paln'; did you mean 'plan'?" in capsys.readouterr().err
    assert main(["profile", "--model", "qwen2.5-7", "--hardware", "h800"]) == 2
    assert "did you mean 'qwen2.5-7b'?" in capsys.readouterr().err
    assert main(["profile", "--model", "tiny-demo", "--hardware", "h80"]) == 2
    assert "did you mean 'h800'?" in capsys.readouterr().err


def test_a_hub_id_is_told_it_is_not_downloaded(capsys) -> None:
    assert main(["profile", "--model", "Qwen/Qwen2.5-7B", "--hardware", "h800"]) == 2
    assert ("hub ids are not downloaded: pass a local directory or a preset"
            in capsys.readouterr().err)
    assert main(["demo", "--model", "Qwen/Qwen2.5-7B"]) == 2
    assert "hub ids are not downloaded: pass a local directory" in capsys.readouterr().err


def test_an_unreadable_dataset_is_an_input_error(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--dataset", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lazytrain demo: cannot read the dataset '{tmp_path}/nope.jsonl' "
                          "(No such file or directory); pass a MetaMathQA-form JSONL")
    assert "Errno" not in err


_PLAN_3B = ["plan", "--model", "qwen2.5-3b", "--batch-size", "8", "--seq-len", "1024"]


def test_planning_flags_left_out_take_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LAZYTRAIN_HARDWARE", "no-such-gpu")
    assert main(_PLAN_3B) == 2  # the variable was read: no silent `auto`
    assert "no-such-gpu" in capsys.readouterr().err
    monkeypatch.setenv("LAZYTRAIN_HARDWARE", "h800")
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_LIMIT_GB", "1")
    assert main(_PLAN_3B) == 2
    assert "GPU short by" in capsys.readouterr().err


def test_a_given_flag_beats_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LAZYTRAIN_HARDWARE", "no-such-gpu")
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_LIMIT_GB", "1")
    assert main([*_PLAN_3B, "--hardware", "h800", "--gpu-memory-gb", "80", "--json"]) == 0
    capsys.readouterr()
    assert main(["profile", "--model", "qwen2.5-3b", "--batch-size", "1", "--seq-len", "128",
                 "--hardware", "h800", "--json"]) == 0
