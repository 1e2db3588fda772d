"""Tiny HF models of several families, padded batches, and a user-style training loop run
through either the stock `accelerate.Accelerator` or LazyTrain's plugin."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import build_model

from lazytrain_accel import Accelerator, LazyTrainPlugin

VOCAB = 96  # engine_helpers' vocabulary
#: The families QA drives, over engine_helpers' configs: dropout on where the config has a
#: knob for it; GPT-2 with tied embeddings and dropout 0.1 everywhere.
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {}, "gemma": {}, "phi3": {"resid_pdrop": 0.1}, "gpt_neox": {}, "opt": {},
    "gpt2": {"bos_token_id": 1, "eos_token_id": 2},
}


def build(arch: str, num_layers: int = 4, seed: int = 0) -> nn.Module:
    # The plugin turns the KV cache off for training; a stock run with it on differs in the
    # last bits (GPT-2's cache concatenation changes the attention matmuls' memory layout).
    return build_model(arch, num_layers, seed, use_cache=False, **OVERRIDES[arch])


def padded_samples(num: int = 8, seq: int = 12, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Right-padded rows (0..3 pad tokens), labels -100 on padding and on a 3-token prompt."""
    ids = torch.randint(3, VOCAB, (num, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(num):
        if row % 4:
            ids[row, -(row % 4):] = 0
            mask[row, -(row % 4):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return [dict(input_ids=ids[i], attention_mask=mask[i], labels=labels[i]) for i in range(num)]


def plugin(tmp_path: Path, plan: str, **kwargs: Any) -> LazyTrainPlugin:
    return LazyTrainPlugin(plan=plan, hardware="h800", cache_dir=str(tmp_path / "cache"),
                           nvme_dir=str(tmp_path / "nvme"), **kwargs)


@dataclass(kw_only=True)
class Run:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """The usual recipe: no weight decay on norms and biases (1-D tensors)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]


def train(model: nn.Module, lazytrain: LazyTrainPlugin | None, *, accumulation: int = 2,
          max_norm: float = 0.5, lr: float = 1e-2, epochs: int = 1) -> Run:
    """A user's Accelerate loop: accumulate, clip, AdamW with decay groups, LR schedule."""
    optimizer = torch.optim.AdamW(decay_groups(model), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    loader = torch.utils.data.DataLoader(padded_samples(), batch_size=2)
    extra = {} if lazytrain is None else {"plugin": lazytrain}
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, **extra)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    run = Run()
    torch.manual_seed(5)  # the same dropout masks in both runs
    for _ in range(epochs):
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                run.losses.append(loss.item())
                if acc.sync_gradients:
                    run.grad_norms.append(float(acc.clip_grad_norm_(model.parameters(),
                                                                    max_norm)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    run.params = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}
    acc.end_training()
    return run
