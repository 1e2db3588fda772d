"""Model configs (built-in presets, HF directories, JSON files) and their per-layer profiles.

Everything is analytic: a 70B model is profiled without allocating a byte of it.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any

from lazytrain_accel.profiling.families import FAMILIES, geometry_from_config
from lazytrain_accel.profiling.profile import ModelGeometry, ModelProfile, WeightSplit
from lazytrain_accel.profiling.working_set import layer_working_set
from lazytrain_accel.suggest import did_you_mean, hub_id_hint

__all__ = ["COMPUTE_DTYPE_BYTES", "FAMILIES", "MODEL_PRESETS", "geometry_from_config",
           "head_working_bytes", "load_model_config", "model_preset_source", "profile_model",
           "with_loss_chunk", "with_tiles"]

#: Built-in model configs, shipped as `lazytrain_accel/presets/<name>.json`.
#: Bytes per element of each compute dtype name the CLI and configs accept.
COMPUTE_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}

MODEL_PRESETS: tuple[str, ...] = (
    "tiny-demo",
    "qwen2.5-3b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen3.6-27b",
    "llama3-8b",
    "llama3-70b",
    "llama3.1-405b",
)

# Each preset JSON is a plain HF config plus this key, saying where the numbers come from.
_SOURCE_KEY = "_lazytrain_source"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object, got "
                         f"{type(data).__name__}")
    return data


def _preset_path(name: str) -> Path:
    return Path(str(resources.files("lazytrain_accel") / "presets" / f"{name}.json"))


def load_model_config(spec: str) -> dict[str, Any]:
    """The HF config dict of `spec`: a preset name (`MODEL_PRESETS`), a local HF model
    directory holding `config.json`, or the path of a config `.json` file."""
    if spec in MODEL_PRESETS:
        config = _read_json(_preset_path(spec), "model preset")
        config.pop(_SOURCE_KEY, None)
        return config
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {spec!r} has no config.json; point --model at "
                             "a HF model directory, a config .json file or a preset")
        return _read_json(path / "config.json", "model config")
    if path.is_file():
        return _read_json(path, "model config")
    raise ValueError(f"model {spec!r} is neither a preset nor an existing HF model directory "
                     f"or config .json file; {hub_id_hint(spec)}{did_you_mean(spec, MODEL_PRESETS)}"
                     f"presets: {', '.join(MODEL_PRESETS)}")


def model_preset_source(name: str) -> str:
    """Where the numbers of preset `name` come from (its `_lazytrain_source` note)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"{name!r} is not a model preset; choose one of {list(MODEL_PRESETS)}")
    return str(_read_json(_preset_path(name), "model preset").get(_SOURCE_KEY, ""))


def _layer_costs(g: ModelGeometry, batch_size: int, seq_len: int, bytes_per_elem: int,
                 weights: WeightSplit | None) -> tuple[int, int, float, float]:
    """(weight bytes streamed H2D, gradient bytes streamed D2H, forward FLOPs, backward
    FLOPs) of one layer; see `profile_model`."""
    tokens = batch_size * seq_len
    matmul_flops = 2.0 * tokens * g.layer_flops_param_count
    attention_flops = 4.0 * batch_size * seq_len * seq_len * g.num_attention_heads * g.head_dim
    fwd_flops = matmul_flops + attention_flops
    if weights is None:
        nbytes = g.layer_param_count * bytes_per_elem
        return nbytes, nbytes, fwd_flops, 2.0 * fwd_flops
    trainable_share = weights.layer_trainable_param_count / max(g.layer_param_count, 1)
    grad_bytes = weights.layer_trainable_param_count * bytes_per_elem
    return (grad_bytes + weights.layer_frozen_h2d_bytes(bytes_per_elem), grad_bytes, fwd_flops,
            2.0 * attention_flops + matmul_flops * (1.0 + trainable_share))


def profile_model(
    geometry: ModelGeometry,
    *,
    batch_size: int,
    seq_len: int,
    compute_bytes_per_elem: int = 2,
    loss_chunk_tokens: int | None = 0,
    weights: WeightSplit | None = None,
    tile_tokens: int | None = 0,
) -> ModelProfile:
    """Per-layer bytes and FLOPs of `geometry` at one micro-batch shape.

    `loss_chunk_tokens` = 0 models HF's own loss (full tokens x vocab logits); > 0 models
    LazyTrain's fused chunked loss, which materializes logits for that many tokens at a
    time (plus the hidden states' gradient); None ("auto") sizes the full logits and
    leaves the choice to the planner (`planning/loss_head.py`).

    FLOPs count 2 per multiply-add. A layer's forward is its matmuls (2 * tokens * layer
    params; biases and norms are within 0.1%; an MoE layer counts its top-k active experts
    only) plus attention's QK^T and AV over the full
    seq x seq square (4 * batch * seq^2 * q_dim); its backward proper is twice its forward
    (input and weight gradients), excluding the forward re-run the engine does first.

    `weights` (LoRA, QLoRA, frozen parts) prices what is stored: a layer streams its
    trainable parameters in the compute dtype and its frozen ones as `weights` says;
    only trainable parameters have gradients, and a frozen matrix's backward computes
    the input gradient only (half of a trainable one's matmul work).

    `tile_tokens` = 0 sizes each layer's working set untiled (`working_set.py`), > 0 with
    its token-wise parts in tiles of that many tokens, None ("auto") untiled, leaving the
    tiles (and query blocks of attention) to the planner (`planning/tiles.py`).
    """
    for field_name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field_name}={value!r} must be a positive integer")
    if compute_bytes_per_elem not in (1, 2, 4):
        raise ValueError(f"compute_bytes_per_elem={compute_bytes_per_elem!r} must be 1, 2 "
                         "(bf16/fp16) or 4 (fp32)")
    tokens = batch_size * seq_len
    g = geometry
    param_bytes, grad_bytes, layer_fwd_flops, layer_bwd_flops = _layer_costs(
        g, batch_size, seq_len, compute_bytes_per_elem, weights)
    head_fwd_flops = 2.0 * tokens * g.hidden_size * g.vocab_size + 5.0 * tokens * g.vocab_size
    resident = g.embedding_param_count + g.head_param_count + g.final_norm_param_count
    working = layer_working_set(g, batch_size=batch_size, seq_len=seq_len,
                                bytes_per_elem=compute_bytes_per_elem, weights=weights,
                                tile_tokens=tile_tokens or 0)
    return ModelProfile(
        geometry=g,
        batch_size=batch_size,
        seq_len=seq_len,
        compute_bytes_per_elem=compute_bytes_per_elem,
        boundary_bytes=tokens * g.hidden_size * compute_bytes_per_elem,
        layer_param_bytes=param_bytes,
        layer_grad_bytes=grad_bytes,
        layer_working_bytes=working.total_bytes,
        layer_working_terms=working.terms(),
        tile_tokens=tile_tokens,
        layer_fwd_flops=layer_fwd_flops,
        layer_bwd_flops=layer_bwd_flops,
        head_fwd_flops=head_fwd_flops,
        resident_param_bytes=resident * compute_bytes_per_elem,
        head_working_bytes=head_working_bytes(g, tokens, compute_bytes_per_elem,
                                              loss_chunk_tokens or 0),
        loss_chunk_tokens=loss_chunk_tokens,
        weights=weights,
    )


def with_loss_chunk(profile: ModelProfile, loss_chunk_tokens: int) -> ModelProfile:
    """`profile` with its head sized for `loss_chunk_tokens` (0 = full logits)."""
    nbytes = head_working_bytes(profile.geometry, profile.tokens_per_step,
                                profile.compute_bytes_per_elem, loss_chunk_tokens)
    return dataclasses.replace(profile, head_working_bytes=nbytes,
                               loss_chunk_tokens=loss_chunk_tokens)


def with_tiles(profile: ModelProfile, tile_tokens: int,
               attention_block_tokens: int = 0) -> ModelProfile:
    """`profile` with its layers' working set sized for `tile_tokens` (0 = untiled) and
    query blocks of `attention_block_tokens` (0 = whole-sequence attention)."""
    working = layer_working_set(profile.geometry, batch_size=profile.batch_size,
                                seq_len=profile.seq_len,
                                bytes_per_elem=profile.compute_bytes_per_elem,
                                weights=profile.weights, tile_tokens=tile_tokens,
                                attention_block_tokens=attention_block_tokens)
    return dataclasses.replace(profile, layer_working_bytes=working.total_bytes,
                               layer_working_terms=working.terms(), tile_tokens=tile_tokens,
                               attention_block_tokens=attention_block_tokens)


def head_working_bytes(g: ModelGeometry, tokens: int, bytes_per_elem: int,
                       loss_chunk_tokens: int) -> int:
    """Logits in the compute dtype + their fp32 upcast + their fp32 gradient, for all
    tokens (HF's loss) or one chunk (fused chunked loss, which also holds the hidden
    states' gradient for all tokens)."""
    if loss_chunk_tokens < 0:
        raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 0 (0 = the "
                         "model's own unchunked loss)")
    per_token_logits = g.vocab_size * (bytes_per_elem + 4 + 4)
    if loss_chunk_tokens == 0 or loss_chunk_tokens >= tokens:
        return tokens * per_token_logits
    return loss_chunk_tokens * per_token_logits + tokens * g.hidden_size * bytes_per_elem
