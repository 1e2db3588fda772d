"""The layer-streaming engine: runs a `Plan` on a HF decoder-only causal LM (docs/engine.md)."""

from lazytrain_accel.engine.activations import BoundaryModifiedError
from lazytrain_accel.engine.discovery import UnsupportedModelError, find_decoder_layers
from lazytrain_accel.engine.engine import StreamingEngine, attach
from lazytrain_accel.engine.stats import StepStats

__all__ = ["BoundaryModifiedError", "StepStats", "StreamingEngine", "UnsupportedModelError",
           "attach", "find_decoder_layers"]
