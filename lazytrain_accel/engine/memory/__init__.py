"""Where tensors live between uses: streamed and quantized weights, residents, activation
boundaries, gradients, and the NVMe tier."""
