"""Profiles of the model and the hardware. Importing this package does not import torch."""

from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.model import ModelGeometry, ModelProfile

__all__ = ["HARDWARE_PRESETS", "HardwareProfile", "ModelGeometry", "ModelProfile"]
