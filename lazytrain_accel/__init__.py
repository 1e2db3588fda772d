"""lazytrain_accel: train LLMs that do not fit on the GPU, from Accelerate or Trainer.

Heavy modules (torch, accelerate, transformers) load on first use of what needs them, so
`lazytrain plan` and the planner stay quick to import.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from lazytrain_accel.config import LazyTrainConfig, LazyTrainPlugin, OptimizerChoice

#: Public names imported on first use: name -> module that defines it.
_LAZY = {
    "Accelerator": "lazytrain_accel.frontends.accelerate",
    "HybridAdamW8bit": "lazytrain_accel.optim",
    "LazyTrainTrainingArguments": "lazytrain_accel.frontends.transformers",
    "LazyTrainTrainer": "lazytrain_accel.frontends.transformers",
    "LazyTrainCallback": "lazytrain_accel.frontends.transformers",
    "apply_lazytrain_to_trainer": "lazytrain_accel.frontends.transformers",
}

__all__ = ["LazyTrainConfig", "LazyTrainPlugin", "OptimizerChoice", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lazytrain_accel' has no attribute {name!r}")
