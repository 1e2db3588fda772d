"""Test helpers: tiny HF models of each family and hand-built plans of each kind."""

from __future__ import annotations

import copy
import gc
import itertools
from typing import Any

import torch
import transformers
from torch import nn

from lazytrain_accel.engine.core.layer_call import ForwardState
from lazytrain_accel.planning.plan import (
    Home,
    Plan,
    Prediction,
    Solution,
    Transfer,
    TransferKind,
)

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)

_MOE = dict(num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.1)

ARCH_CONFIGS = {
    "llama": lambda n: transformers.LlamaConfig(num_hidden_layers=n, **_COMMON),
    "qwen2": lambda n: transformers.Qwen2Config(num_hidden_layers=n, **_COMMON),
    "qwen3": lambda n: transformers.Qwen3Config(num_hidden_layers=n, head_dim=8, **_COMMON),
    "mistral": lambda n: transformers.MistralConfig(num_hidden_layers=n, **_COMMON),
    "gemma": lambda n: transformers.GemmaConfig(num_hidden_layers=n, head_dim=8, **_COMMON),
    "phi3": lambda n: transformers.Phi3Config(num_hidden_layers=n, pad_token_id=0, **_COMMON),
    "gpt_neox": lambda n: transformers.GPTNeoXConfig(
        num_hidden_layers=n, vocab_size=96, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.1),
    "opt": lambda n: transformers.OPTConfig(
        num_hidden_layers=n, vocab_size=96, hidden_size=32, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.1),
    "gpt2": lambda n: transformers.GPT2Config(n_layer=n, vocab_size=96, n_embd=32, n_head=4,
                                              n_positions=64),
    # families outside the profiling table: the engine and the live profile are generic
    "gpt_bigcode": lambda n: transformers.GPTBigCodeConfig(
        n_layer=n, vocab_size=96, n_embd=32, n_head=4, n_positions=64),
    "starcoder2": lambda n: transformers.Starcoder2Config(num_hidden_layers=n, **_COMMON),
    "stablelm": lambda n: transformers.StableLmConfig(num_hidden_layers=n, **_COMMON),
    "bloom": lambda n: transformers.BloomConfig(n_layer=n, vocab_size=96, hidden_size=32,
                                                n_head=4),
    "falcon": lambda n: transformers.FalconConfig(num_hidden_layers=n, vocab_size=96,
                                                  hidden_size=32, num_attention_heads=4),
    # MoE with the router auxiliary loss on: its gradient reaches the layers
    "mixtral": lambda n: transformers.MixtralConfig(num_hidden_layers=n, **_MOE, **_COMMON),
    "qwen3_moe": lambda n: transformers.Qwen3MoeConfig(
        num_hidden_layers=n, num_experts=_MOE["num_local_experts"], head_dim=8,
        moe_intermediate_size=32, **{k: v for k, v in _MOE.items() if k != "num_local_experts"},
        **_COMMON),
}

PLAN_KINDS = ("checkpoint_all", "megatrain", "offload_all", "all_nvme", "mixed")


def build_model(arch: str, num_layers: int, seed: int = 0, **overrides: object) -> nn.Module:
    config = ARCH_CONFIGS[arch](num_layers)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def fail_writes(monkeypatch: Any, error: int) -> None:
    """Make every direct-I/O write fail with `error` (an errno) until `monkeypatch.undo()`."""
    import os

    from lazytrain_accel.storage import direct_io

    def broken(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(direct_io.os, "pwrite", broken)


def detach_leaves_no_files(engine: Any) -> None:
    """Detach `engine` and check that its NVMe directories (boundaries, state files) are
    gone."""
    directories = engine.spill.directories
    engine.detach()
    assert not any(d.exists() for d in directories)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_states_die_by_refcount(model: nn.Module, engine: Any) -> None:
    """A backwarded pass and a dropped one of `model` (attached as `engine`) leave none of
    its `ForwardState`s alive, with the cyclic collector off: no reference cycle runs
    through an autograd graph. (Only this engine's: an earlier test of the same worker
    process may hold one of its own.)"""
    gc.collect()
    gc.disable()
    try:
        ids = batches(1)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        loss = model(input_ids=ids, labels=ids).loss
        del loss
        alive = [o for o in gc.get_objects()
                 if isinstance(o, ForwardState) and o.rt is engine.runtime]
        assert not alive, f"{len(alive)} forward states of this engine alive"
    finally:
        gc.enable()


def _homes(kind: str, num_layers: int) -> list[Home]:
    L = num_layers
    inner = {"checkpoint_all": Home.GPU, "offload_all": Home.CPU, "all_nvme": Home.NVME}
    if kind in inner:
        return [Home.GPU] + [inner[kind]] * (L - 1) + [Home.GPU]
    if kind == "megatrain":
        return [Home.GPU if i % 4 == 0 or i == L else Home.RECOMPUTE for i in range(L + 1)]
    if kind == "mixed":  # blocks (0,1) (1,3) (3,6) (6,10): lengths 1..4, every home kind
        if L != 10:
            raise ValueError(f"the mixed test plan is for 10 layers, not {L}")
        marks = {0: Home.GPU, 1: Home.CPU, 3: Home.NVME, 6: Home.CPU, 10: Home.GPU}
        return [marks.get(i, Home.RECOMPUTE) for i in range(L + 1)]
    raise ValueError(f"unknown plan kind {kind!r}; use one of {PLAN_KINDS}")


def _transfers(homes: list[Home], boundary_bytes: int) -> list[Transfer]:
    """Offload right after production, reload one window before the backward needs it."""
    L = len(homes) - 1
    out = []
    for b, home in enumerate(homes):
        if home not in (Home.CPU, Home.NVME):
            continue
        d2h = b
        h2d = max(d2h, 2 * L - b - 2)
        out.append(Transfer(boundary=b, kind=TransferKind.D2H, window=d2h, bytes=boundary_bytes))
        if home == Home.NVME:
            write = min(b + 1, L - 1)
            read = max(write, 2 * L - b - 3)
            h2d = max(h2d, read)
            out += [Transfer(boundary=b, kind=TransferKind.NVME_WRITE, window=write,
                             bytes=boundary_bytes),
                    Transfer(boundary=b, kind=TransferKind.NVME_READ, window=read,
                             bytes=boundary_bytes)]
        out.append(Transfer(boundary=b, kind=TransferKind.H2D, window=h2d, bytes=boundary_bytes))
    return out


def make_plan(kind: str, num_layers: int, *, boundary_bytes: int = 4096,
              transfers: bool = True) -> Plan:
    homes = _homes(kind, num_layers)
    marks = [i for i, h in enumerate(homes) if h != Home.RECOMPUTE]
    return Plan(
        strategy=f"test_{kind}", num_layers=num_layers, batch_size=2, seq_len=16,
        boundary_bytes=boundary_bytes, homes=homes, blocks=list(itertools.pairwise(marks)),
        transfers=_transfers(homes, boundary_bytes) if transfers else [],
        prediction=Prediction(step_s=0.0, compute_s=0.0, recompute_s=0.0, exposed_s=0.0),
        solver=Solution(status="baseline", homes=tuple(homes)), fingerprint="test",
    )


def batches(num: int, *, vocab: int = 96, batch: int = 2, seq: int = 16, seed: int = 1
            ) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(num)]


def train_clipped(model: nn.Module, plan: Plan, nvme_dir: Any, *, steps: int = 3,
                  micro_batches: int = 2, dtype: torch.dtype = torch.float32,
                  poison_step: int | None = None, after_backward: Any = None,
                  after_step: Any = None, engine: Any = None, **optimizer_kwargs: Any
                  ) -> tuple[Any, Any, list[float]]:
    """`steps` steps of the hybrid 8-bit update clipped at 1.0 (lr 1e-2, `optimizer_kwargs`
    beside), each of `micro_batches` micro-batches, on `engine` or one attached with
    `plan`, `dtype` and `nvme_dir`; `poison_step`: that step's loss made non-finite (the
    step skipped). `after_backward(engine, step)` before each step, `after_step(engine,
    optimizer, step)` after it. Returns (engine, optimizer, losses)."""
    from lazytrain_accel.engine import attach
    from lazytrain_accel.optim import HybridAdamW8bit

    engine = engine or attach(model, plan, device=torch.device("cpu"), compute_dtype=dtype,
                              nvme_dir=str(nvme_dir))
    opt = HybridAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                          max_grad_norm=1.0, **optimizer_kwargs)
    losses = []
    data = batches(steps * micro_batches)
    for step in range(steps):
        for ids in data[step * micro_batches:(step + 1) * micro_batches]:
            loss = model(input_ids=ids, labels=ids).loss / micro_batches
            if step == poison_step:
                loss = loss * float("inf")
            loss.backward()
            losses.append(loss.item())
        if after_backward is not None:
            after_backward(engine, step)
        engine.step_layerwise(opt)
        engine.synchronize()
        opt.zero_grad()
        if after_step is not None:
            after_step(engine, opt, step)
    return engine, opt, losses
