"""Several ranks on a node: the shared node store, the split update, rank placement and the
per-layer all-reduce."""
