"""What `import lazytrain_accel` gives a user, and what it costs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_trainer_names_import_from_the_package_lazily() -> None:
    code = ("import json, sys\n"
            "import lazytrain_accel\n"
            "light = 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
            "from lazytrain_accel import (LazyTrainCallback, LazyTrainTrainer,\n"
            "    LazyTrainTrainingArguments, apply_lazytrain_to_trainer)\n"
            "from lazytrain_accel.frontends import transformers as module\n"
            "same = [LazyTrainCallback, LazyTrainTrainer, LazyTrainTrainingArguments,\n"
            "        apply_lazytrain_to_trainer] == [module.LazyTrainCallback,\n"
            "    module.LazyTrainTrainer, module.LazyTrainTrainingArguments,\n"
            "    module.apply_lazytrain_to_trainer]\n"
            "print(json.dumps([light, same]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO)
    assert json.loads(done.stdout.splitlines()[-1]) == [True, True]


def test_the_demo_writes_to_the_one_git_ignored_output_dir() -> None:
    from lazytrain_accel.demo.run import DEFAULT_OUTPUT_DIR, DemoSettings

    assert DemoSettings().output_dir == DEFAULT_OUTPUT_DIR == "lazytrain_output"
    ignored = {line.strip("/") for line in (REPO / ".gitignore").read_text().split()}
    assert DEFAULT_OUTPUT_DIR in ignored


def test_a_hanging_test_fails_within_the_suites_timeout(tmp_path: Path,
                                                        request: pytest.FixtureRequest) -> None:
    """A hang is a failure, never a wait of 30 minutes: the suite runs under
    pytest-timeout with a per-test limit of minutes, and a test that sleeps past a limit
    fails (run here in a child pytest with the limit shortened to 2 s)."""
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not loaded"
    limit_s = float(request.config.getini("timeout"))
    assert 0 < limit_s <= 900, f"per-test timeout {limit_s} s: a hang must fail within minutes"
    (tmp_path / "test_hang.py").write_text("import time\n\n\ndef test_hang():\n"
                                           "    time.sleep(120)\n")
    start_s = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--timeout=2", str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=90)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "Timeout" in done.stdout + done.stderr
    assert time.monotonic() - start_s < 60
