"""The demo's model: a small Qwen2 built from a config held here, or a local HF directory.

The `tiny-demo` preset (8 x 256, 6.2M parameters, a 1024-token vocabulary) costs about
four times the FLOPs per step of this model; the 300 steps that take the demo from 0% to
68% exact match are most of the demo's time on 2 cores, so the demo model is narrower
(hidden 128) with the same depth: the plan still has eight layers and nine boundaries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lazytrain_accel.data.tokenizer import build_demo_tokenizer
from lazytrain_accel.suggest import hub_id_hint

#: Qwen2 shape of the demo model; vocabulary size and special ids come from the tokenizer.
DEMO_MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
}


def build_demo_model(tokenizer: PreTrainedTokenizerBase, *, seed: int) -> PreTrainedModel:
    """A freshly initialised demo model whose vocabulary is `tokenizer`'s (same seed, same
    weights)."""
    config = Qwen2Config(**DEMO_MODEL_CONFIG, vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    config.name_or_path = "lazytrain-demo-qwen2"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_model_and_tokenizer(model_dir: str | None, train_texts: list[str], *,
                             seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model of `model_dir` (a local HF directory with weights and a tokenizer) in
    fp32, or, without one, the demo model and a Qwen2 BPE tokenizer learned from the texts."""
    if model_dir is None:
        tokenizer = build_demo_tokenizer(train_texts)
        return build_demo_model(tokenizer, seed=seed), tokenizer
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        hint = "" if path.exists() else hub_id_hint(model_dir, presets=False)
        raise ValueError(f"--model {model_dir!r} is not a HF model directory (no config.json); "
                         + (hint.rstrip("; ") or "pass a directory written by save_pretrained"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        # Decoder-only tokenizers often lack a pad token; padding positions are masked
        # out of the loss and the attention anyway, so the end token serves.
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tokenizer
