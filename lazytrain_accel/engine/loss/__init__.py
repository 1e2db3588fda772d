"""The loss head: the fused linear cross-entropy, lazy logits and the patch that installs them."""
