"""Tiny model, loader and a plan JSON homing boundaries where a fault test needs them."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel.planning.plan import (
    Home,
    Plan,
    Prediction,
    Solution,
    Transfer,
    TransferKind,
)
from lazytrain_accel.profiling.fingerprint import run_fingerprint
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.run import setup

NUM_LAYERS, BATCH, SEQ, VOCAB = 4, 4, 12, 64


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config)


def loader(num_batches: int = 4, seed: int = 1) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, VOCAB, (num_batches * BATCH, SEQ),
                        generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)


def plan_json(tmp_path: Path, model: torch.nn.Module, home: Home, *,
              hardware: str = "h800") -> str:
    """A plan homing boundaries 1..L-1 on `home`, fingerprinted for `model` at the loader's
    shape in fp32 on `hardware`, saved as JSON; returns its path."""
    profile = setup.profile_for_run(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=None)
    L, nbytes = NUM_LAYERS, profile.boundary_bytes
    homes = [Home.GPU] + [home] * (L - 1) + [Home.GPU]
    transfers = []
    for b in range(1, L):
        if home == Home.GPU:
            continue
        transfers.append(Transfer(boundary=b, kind=TransferKind.D2H, window=b, bytes=nbytes))
        if home == Home.NVME:
            transfers += [
                Transfer(boundary=b, kind=TransferKind.NVME_WRITE, window=min(b + 1, L - 1),
                         bytes=nbytes),
                Transfer(boundary=b, kind=TransferKind.NVME_READ,
                         window=max(min(b + 1, L - 1), 2 * L - b - 3), bytes=nbytes)]
        transfers.append(Transfer(boundary=b, kind=TransferKind.H2D,
                                  window=max(b, 2 * L - b - 2), bytes=nbytes))
    plan = Plan(strategy=f"test_{home.value}", num_layers=L, batch_size=BATCH, seq_len=SEQ,
                boundary_bytes=nbytes, homes=homes,
                blocks=list(itertools.pairwise(range(L + 1))), transfers=transfers,
                prediction=Prediction(step_s=0.0, compute_s=0.0, recompute_s=0.0,
                                      exposed_s=0.0),
                solver=Solution(status="baseline", homes=tuple(homes)),
                fingerprint=run_fingerprint(profile, load_hardware(hardware)))
    path = tmp_path / f"plan_{home.value}.json"
    plan.save(path)
    return str(path)
