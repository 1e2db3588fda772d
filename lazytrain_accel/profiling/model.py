"""Model profiles: geometry of a decoder-only LM and its per-layer costs at a batch shape.

Everything here is analytic (from a HF `config.json`), so it works for models far larger
than this machine; `measure.py` refines the seconds on real hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(kw_only=True, frozen=True)
class ModelGeometry:
    """Shape of a decoder-only LM, read from its HF config. Counts are parameters."""

    name: str
    family: str  # HF model_type: "llama", "qwen2", "gpt2", ...
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    layer_param_count: int  # one decoder layer (all layers of these families are identical)
    embedding_param_count: int  # token (+ position) embeddings
    head_param_count: int  # lm_head; 0 when tied to the embeddings
    final_norm_param_count: int
    # Gated MLPs (SwiGLU/GeGLU: gate, up, down) keep more intermediates alive in backward
    # than two-matrix MLPs (GPT-2, GPT-NeoX, OPT); the working-set estimate needs to know.
    gated_mlp: bool = True
    # Parameters one token's FLOPs go through in a layer: an MoE layer streams all its
    # experts (layer_param_count) but computes with top_k of them. None = dense.
    active_layer_param_count: int | None = None

    @property
    def layer_flops_param_count(self) -> int:
        """Parameters per layer that the FLOP count multiplies (active ones for MoE)."""
        active = self.active_layer_param_count
        return self.layer_param_count if active is None else active

    @property
    def total_param_count(self) -> int:
        return (self.num_layers * self.layer_param_count + self.embedding_param_count
                + self.head_param_count + self.final_norm_param_count)

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["active_layer_param_count"] is None:  # dense: plan fingerprints stay as before
            del out["active_layer_param_count"]
        return out


@dataclass(kw_only=True, frozen=True)
class ModelProfile:
    """A model at one (batch, seq, dtype): the planner's per-layer inputs.

    Boundary i (0..L) is the hidden state entering layer i+1 (i = 0) or leaving layer i.
    """

    geometry: ModelGeometry
    batch_size: int
    seq_len: int
    compute_bytes_per_elem: int  # 2 for bf16/fp16 compute, 4 for fp32
    boundary_bytes: int  # A = batch * seq * hidden * compute_bytes_per_elem
    layer_param_bytes: int  # one layer's weights in the compute dtype (what streams H2D)
    layer_grad_bytes: int  # one layer's weight gradients as they stream D2H
    layer_working_bytes: int  # peak extra device bytes while one layer runs its backward
    layer_fwd_flops: float  # one layer's forward at this batch shape
    layer_bwd_flops: float  # one layer's backward proper (excludes its forward re-run)
    head_fwd_flops: float  # final norm + lm_head + loss forward
    resident_param_bytes: int  # embeddings + final norm + head kept on the device
    # Peak extra device bytes of the head + loss forward/backward: HF's unchunked loss
    # keeps tokens x vocab logits in the compute dtype, their fp32 upcast and fp32 grad.
    head_working_bytes: int = 0
    # The loss `head_working_bytes` was sized for: 0 = the model's own (full logits), N =
    # the fused chunked loss at N tokens per chunk, None = "auto", for the planner to
    # decide (head_working_bytes is then the full logits').
    loss_chunk_tokens: int | None = 0

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:
        out = asdict(self)
        out["geometry"] = self.geometry.to_dict()
        return out
