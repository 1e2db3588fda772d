"""Checkpoints: atomic directories, the safetensors layout, share checkpoints and
asynchronous saves."""
