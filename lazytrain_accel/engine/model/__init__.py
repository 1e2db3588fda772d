"""How the engine meets a HF model: finding its decoder layers, binding their arguments, patching
their forward, and what a layer call must keep to re-run it (RNG, autocast, captured outputs)."""
