"""One optimizer step beside the engine: the step coordinator, the layer-wise update overlapped
with the next forward, and the fidelity monitor."""
