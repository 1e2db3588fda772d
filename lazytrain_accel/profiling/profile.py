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
    # Why the layers run whole rather than in sequence tiles (`whole_layers.py`, from the
    # config: MoE router logits recorded, non-causal attention); "" = they can run in tiles.
    whole_layer_reason: str = ""

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
        if not out["whole_layer_reason"]:  # tileable: plan fingerprints stay as before
            del out["whole_layer_reason"]
        return out


#: Storage formats of frozen weights: plain dtypes, and bitsandbytes' LLM.int8 and 4-bit.
FROZEN_FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp32", "int8", "nf4", "fp4")
#: Of those, the packed ones: they stream as stored and compute through bitsandbytes.
QUANTIZED_FORMATS: tuple[str, ...] = ("int8", "nf4", "fp4")


@dataclass(kw_only=True, frozen=True)
class WeightSplit:
    """Trainable vs frozen parameters (LoRA, QLoRA, frozen embeddings), per decoder layer
    and for the resident modules, and how the frozen ones are stored.

    Trainable parameters cost what a full fine-tune costs per parameter (fp32 master,
    gradient and optimizer state on the host; compute-dtype copy and gradient on the
    link). Frozen ones cost their stored bytes on the host, and cross H2D either as
    stored (packed bitsandbytes weights and their scales) or cast to the compute dtype.
    """

    layer_trainable_param_count: int
    layer_frozen_param_count: int
    layer_frozen_host_bytes: int  # frozen weights of one layer as stored on the host
    # Of the frozen ones, bitsandbytes-packed (int8/nf4/fp4): they stream as stored, data
    # and scales; the other frozen ones stream cast to the compute dtype.
    layer_packed_param_count: int = 0
    layer_packed_bytes: int = 0  # packed data + quantization scales
    layer_frozen_scale_bytes: int = 0  # the scales (absmax, SCB) alone
    # Elements of the largest packed matrix: its compute-dtype copy exists while its
    # bitsandbytes linear runs (dequantized per call), beside the layer's working set.
    layer_dequant_elems: int = 0
    resident_trainable_param_count: int = 0
    resident_frozen_param_count: int = 0
    resident_frozen_host_bytes: int = 0
    frozen_format: str = "bf16"  # the format holding most frozen parameters (FROZEN_FORMATS)

    def __post_init__(self) -> None:
        if self.frozen_format not in FROZEN_FORMATS:
            raise ValueError(f"WeightSplit.frozen_format={self.frozen_format!r}: expected "
                             f"one of {list(FROZEN_FORMATS)}")
        if self.layer_packed_param_count > self.layer_frozen_param_count:
            raise ValueError(f"WeightSplit.layer_packed_param_count="
                             f"{self.layer_packed_param_count} exceeds layer_frozen_param_"
                             f"count={self.layer_frozen_param_count}: packed weights are frozen")
        for name in ("layer_trainable_param_count", "layer_frozen_param_count",
                     "layer_frozen_host_bytes", "layer_packed_bytes",
                     "resident_trainable_param_count", "resident_frozen_param_count",
                     "resident_frozen_host_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"WeightSplit.{name}={getattr(self, name)} is negative")

    def layer_frozen_h2d_bytes(self, compute_bytes_per_elem: int) -> int:
        """One layer's frozen weights as they cross H2D: packed as stored, the rest cast."""
        floats = self.layer_frozen_param_count - self.layer_packed_param_count
        return self.layer_packed_bytes + floats * compute_bytes_per_elem

    def layer_dequant_bytes(self, compute_bytes_per_elem: int) -> int:
        """Device bytes one pass over a layer's packed linears moves to dequantize them
        (bitsandbytes, once per call: forward, forward re-run, backward): the packed data
        and scales read, their compute-dtype copy written. 0 without packed weights."""
        if not self.layer_packed_param_count:
            return 0
        return self.layer_packed_bytes + self.layer_packed_param_count * compute_bytes_per_elem

    def to_dict(self) -> dict:
        return asdict(self)


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
    # Which parameters train and how frozen ones are stored; None = a full fine-tune
    # (every parameter trainable, kept as an fp32 master).
    weights: WeightSplit | None = None
    # Tokens per tile of each layer's token-wise parts (0: untiled, None: "auto", for the
    # planner to decide, `planning/tiles.py`; the working set is then the untiled one),
    # and tokens per query block of its attention backward (0: the whole sequence).
    tile_tokens: int | None = 0
    attention_block_tokens: int = 0
    # layer_working_bytes term by term, largest first (`working_set.LayerWorkingSet`);
    # empty for profiles built by hand.
    layer_working_terms: tuple[tuple[str, int], ...] = ()

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def layer_trainable_param_count(self) -> int:
        """Parameters of one layer that get gradients and a host update."""
        w = self.weights
        return self.geometry.layer_param_count if w is None else w.layer_trainable_param_count

    @property
    def resident_trainable_param_count(self) -> int:
        g, w = self.geometry, self.weights
        resident = g.total_param_count - g.num_layers * g.layer_param_count
        return resident if w is None else w.resident_trainable_param_count

    @property
    def trainable_param_count(self) -> int:
        """Parameters with an fp32 master, a gradient and optimizer state on the host."""
        return (self.num_layers * self.layer_trainable_param_count
                + self.resident_trainable_param_count)

    @property
    def frozen_host_bytes(self) -> int:
        """Host bytes of every frozen weight as stored (0 for a full fine-tune)."""
        w = self.weights
        return 0 if w is None else (self.num_layers * w.layer_frozen_host_bytes
                                    + w.resident_frozen_host_bytes)

    @property
    def resident_grad_bytes(self) -> int:
        """Device gradients of the trainable resident parameters (compute dtype)."""
        return self.resident_trainable_param_count * self.compute_bytes_per_elem

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:
        out = asdict(self)
        out["geometry"] = self.geometry.to_dict()
        return out
