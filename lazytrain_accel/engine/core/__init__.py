"""The engine's core: attaching to a model, the layer call and the per-layer runtime."""
