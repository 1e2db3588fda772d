"""The layer-streaming engine: runs a `Plan` on a HF decoder-only causal LM (docs/engine.md)."""

from lazytrain_accel.engine.core.engine import StreamingEngine, attach
from lazytrain_accel.engine.loss.fused_loss import causal_lm_loss, fused_linear_cross_entropy
from lazytrain_accel.engine.loss.lazy_logits import LogitsNotMaterializedError
from lazytrain_accel.engine.loss.loss_patch import FusedLoss, apply_fused_loss
from lazytrain_accel.engine.memory.activations import BoundaryModifiedError
from lazytrain_accel.engine.model.discovery import UnsupportedModelError, find_decoder_layers
from lazytrain_accel.engine.stats import StepStats

__all__ = ["BoundaryModifiedError", "FusedLoss", "LogitsNotMaterializedError", "StepStats",
           "StreamingEngine",
           "UnsupportedModelError", "apply_fused_loss", "attach", "causal_lm_loss",
           "find_decoder_layers", "fused_linear_cross_entropy"]
