"""The LazyTrain `Accelerator` as `transformers.Trainer` drives it.

Trainer's calls differ from a hand-written Accelerate loop in three ways this subclass
absorbs, without changing the Accelerator that Accelerate users get:

* it prepares each DataLoader alone (`prepare(loader)`, no model), then the model and the
  optimizer without any loader, so the plan must be sized from the loader seen earlier;
* evaluation before training prepares the model through `prepare_model`, which on the stock
  path would move the whole model to the device;
* `train()` may run more than once (or after `evaluate()`): the engine is attached once.
"""

from __future__ import annotations

import logging
from typing import Any

import accelerate
from torch import nn

from lazytrain_accel.config import LazyTrainConfig
from lazytrain_accel.frontends.accelerate import Accelerator

logger = logging.getLogger("lazytrain_accel")


class TrainerAccelerator(Accelerator):
    """`lazytrain_accel.Accelerator` with a plugin, adapted to Trainer's prepare calls."""

    #: Ctrl-C sets a flag `LazyTrainCallback` turns into a clean stop (and a checkpoint).
    _lazytrain_interrupt_raises = False

    def __init__(self, *args: Any, plugin: LazyTrainConfig, **kwargs: Any) -> None:
        super().__init__(*args, plugin=plugin, **kwargs)
        #: the training DataLoader the plan is sized from (set by the Trainer integration).
        self.lazytrain_sizing_loader: Any = None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if not any(isinstance(a, nn.Module) for a in args):
            # DataLoaders (and schedulers) alone: nothing to stream, the stock path shards them.
            return accelerate.Accelerator.prepare(self, *args, device_placement=device_placement)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Attach the engine instead of moving the model (evaluation before training)."""
        self._lazytrain_prepare_model(model, None)
        return model

    def _lazytrain_prepare_model(self, model: nn.Module, loader: Any) -> None:
        if self.lazytrain is not None:
            if model is not self.lazytrain.model:
                streamed = type(self.lazytrain.model).__name__
                raise ValueError(
                    f"this Trainer's LazyTrain engine already streams a {streamed}; it cannot "
                    f"prepare a second model ({type(model).__name__}). Build a new Trainer "
                    "for another model."
                )
            if model not in self._models:  # `free_memory()` at train start forgot it
                self._models.append(model)
            return
        super()._lazytrain_prepare_model(model, loader or self.lazytrain_sizing_loader)
