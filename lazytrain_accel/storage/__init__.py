"""Host state on the disk: one direct-I/O module (`direct_io.py`) for the engine's state
files, the activation boundaries and the checkpoints. Design: docs/architecture.md
"Direct I/O"; figures: docs/benchmarks.md "Direct I/O"."""
