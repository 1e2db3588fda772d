"""Long sequences: tiles of the MLP, query blocks of attention, whole-layer tiles."""
