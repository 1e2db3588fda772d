"""What `import lazytrain_accel` gives a user, and what it costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_trainer_names_import_from_the_package_lazily() -> None:
    code = ("import json, sys\n"
            "import lazytrain_accel\n"
            "light = 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
            "from lazytrain_accel import (LazyTrainCallback, LazyTrainTrainer,\n"
            "    LazyTrainTrainingArguments, apply_lazytrain_to_trainer)\n"
            "from lazytrain_accel.integrations import transformers as module\n"
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
