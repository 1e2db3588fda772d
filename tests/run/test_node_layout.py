"""`residents.update_groups`, called before the engine is attached (the node store's
placement by owner, `run/node_layout.py`), gives the engine's own update groups."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.memory.residents import update_groups
from lazytrain_accel.engine.model.discovery import find_decoder_layers
from lazytrain_accel.planning.plan import Home, Plan, Prediction, Solution


def _plan(num_layers: int) -> Plan:
    homes = [Home.GPU] * (num_layers + 1)
    return Plan(strategy="test_checkpoint_all", num_layers=num_layers, batch_size=2,
                seq_len=16, boundary_bytes=4096, homes=homes,
                blocks=list(itertools.pairwise(range(num_layers + 1))), transfers=[],
                prediction=Prediction(step_s=0.0, compute_s=0.0, recompute_s=0.0,
                                      exposed_s=0.0),
                solver=Solution(status="baseline", homes=tuple(homes)), fingerprint="test")


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen2", "gpt2"])
def test_the_groups_are_the_engines(family: str, tmp_path: Path) -> None:
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, vocab_size=96, n_embd=32, n_head=4,
                                           n_positions=64))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=family == "qwen2_tied"))
    before = [[id(p) for p in g] for g in update_groups(model, *find_decoder_layers(model))]
    engine = attach(model, _plan(3), device=torch.device("cpu"), nvme_dir=str(tmp_path))
    try:
        assert before == [[id(p) for p in g] for g in engine.steps.update_groups]
    finally:
        engine.detach()
