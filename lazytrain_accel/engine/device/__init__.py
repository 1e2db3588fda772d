"""The device side: copy streams and events (CUDA, synchronous CPU, emulated async), pinning."""
