"""Profiles of the model and the hardware. Importing this package does not import torch
(only `load_hardware("auto")` does, through `measure.py`)."""

from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.model_configs import (
    MODEL_PRESETS,
    geometry_from_config,
    load_model_config,
    profile_model,
)
from lazytrain_accel.profiling.profile import ModelGeometry, ModelProfile

__all__ = ["HARDWARE_PRESETS", "MODEL_PRESETS", "HardwareProfile", "ModelGeometry",
           "ModelProfile", "geometry_from_config", "load_hardware", "load_model_config",
           "profile_model"]
