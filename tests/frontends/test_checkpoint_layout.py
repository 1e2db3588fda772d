"""The checkpoint's weights layout (checkpoints/layout.py): shards and their
index at a small max shard size, reloaded exactly by `from_pretrained`; an export dtype
whose fp32 masters the shares keep, so a resume is exact; the settings."""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.utils.hub import convert_file_size_to_int

from lazytrain_accel.checkpoints import layout as layout
from lazytrain_accel.checkpoints import resume
from lazytrain_accel.checkpoints import share_format as sc
from lazytrain_accel.config import CHECKPOINT_DTYPE_CHOICES, LazyTrainConfig
from lazytrain_accel.frontends import share_checkpoint
from lazytrain_accel.optim import HybridAdamW8bit

SMALL_SHARD_BYTES = 40_000  # the tiny model's ~190 KB of fp32 weights: several shards


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True))


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = HybridAdamW8bit(model.parameters(), lr=1e-2, backend="torch")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _accelerator(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, dtype: str,
                 max_shard_bytes: int) -> SimpleNamespace:
    """What `save_shares` / `load_shares` read of one process's Accelerator."""
    groups = [list(model.parameters())]
    steps = SimpleNamespace(update_groups=groups, peers=None, remote=None)
    plugin = SimpleNamespace(checkpoint_dtype=dtype, checkpoint_max_shard_bytes=max_shard_bytes)
    engine = SimpleNamespace(steps=steps, masters_in_dram=lambda _: contextlib.nullcontext())
    lazytrain = SimpleNamespace(engine=engine, model=model, optimizer=optimizer)
    return SimpleNamespace(lazytrain=lazytrain, step=2, lazytrain_plugin=plugin,
                           is_main_process=True)


def _state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    names = sc.param_names(model)
    return {(names[p], k): v for p, s in optimizer.state.items() for k, v in s.items()}


def test_small_shards_get_an_index_and_from_pretrained_reloads_them_exactly(
        tmp_path: Path) -> None:
    model = _model()
    files = sc.write_weights(tmp_path, model, max_shard_bytes=SMALL_SHARD_BYTES)
    shards = [f for f in files if f != layout.INDEX]
    assert len(shards) >= 3 and files[-1] == layout.INDEX
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    assert not (tmp_path / layout.WEIGHTS).exists()
    index = json.loads((tmp_path / layout.INDEX).read_text())
    assert set(index["weight_map"]) == {n for n, _ in sc.unique_state(model)}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for _, t in sc.unique_state(model))
    for shard in shards:  # every shard within the bound unless one tensor alone exceeds it
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118
        numels = [int(torch.tensor(s).prod()) for s in sizes]
        assert len(numels) == 1 or 4 * sum(numels) <= SMALL_SHARD_BYTES, shard
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, p), (name2, q) in zip(model.state_dict().items(),
                                     loaded.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(p, q), name
    fresh = _model(seed=3)
    assert resume.load_weights(fresh, tmp_path, loads=lambda t: True) == len(
        sc.unique_state(model))
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters(),
                                                 strict=True))
    assert sc.saved_elements(tmp_path) == sum(t.numel() for _, t in sc.unique_state(model))


def test_a_tensor_larger_than_a_shard_gets_one_of_its_own() -> None:
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(100)), ("c", torch.zeros(5)),
               ("d", torch.zeros(5))]
    shards = layout.plan_shards(tensors, max_shard_bytes=60, dtype=None)
    assert [[n for n, _ in s] for s in shards] == [["a"], ["b"], ["c", "d"]]
    in_bf16 = layout.plan_shards(tensors, max_shard_bytes=60, dtype=torch.bfloat16)
    assert [[n for n, _ in s] for s in in_bf16] == [["a"], ["b"], ["c", "d"]]
    assert [[n for n, _ in s] for s in layout.plan_shards(
        tensors[:1] + tensors[2:], max_shard_bytes=60, dtype=torch.bfloat16)] == [
            ["a", "c", "d"]]
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        layout.plan_shards(tensors, max_shard_bytes=0, dtype=None)


def test_bf16_export_weights_with_the_fp32_masters_in_the_share(tmp_path: Path) -> None:
    """One process (no process group): the weights files in bf16 for export, the share
    holds the fp32 masters; the resume gets the masters and the state bit for bit."""
    model, optimizer = _trained()
    final = tmp_path / "ckpt"
    share_checkpoint.save_shares(_accelerator(model, optimizer, dtype="bfloat16",
                                              max_shard_bytes=SMALL_SHARD_BYTES), final,
                                 write_stock=lambda d: None)
    assert (final / layout.INDEX).is_file() and (final / sc.MANIFEST).is_file()
    exported = Qwen2ForCausalLM.from_pretrained(final)
    for (name, p), q in zip(model.state_dict().items(), exported.state_dict().values(),
                            strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), q), name

    fresh = _model(seed=5)
    new = HybridAdamW8bit(fresh.parameters(), lr=1.0, backend="torch")
    share_checkpoint.load_shares(_accelerator(fresh, new, dtype="auto", max_shard_bytes=1),
                                 final, sc.read_manifest(final))
    for (name, p), q in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    saved, loaded = _state(optimizer, model), _state(new, fresh)
    assert saved.keys() == loaded.keys() and sc.MASTER_KEY not in {k for _, k in loaded}
    assert all(torch.equal(v, loaded[k]) if isinstance(v, torch.Tensor) else v == loaded[k]
               for k, v in saved.items())


def test_the_settings_default_to_save_pretrained_s_and_refuse_bad_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stock = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"]
    config = LazyTrainConfig()
    assert config.checkpoint_max_shard_bytes == convert_file_size_to_int(stock.default)
    assert config.checkpoint_max_shard_bytes == layout.DEFAULT_MAX_SHARD_BYTES
    assert config.checkpoint_dtype == "auto"
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_DTYPE", "BFloat16")
    assert LazyTrainConfig().checkpoint_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"checkpoint_dtype='fp8'.*argument"):
        LazyTrainConfig(checkpoint_dtype="fp8")
    with pytest.raises(ValueError, match=r"checkpoint_max_shard_bytes=0 must be > 0"):
        LazyTrainConfig(checkpoint_max_shard_bytes=0)
    assert set(layout.CHECKPOINT_DTYPES) == set(CHECKPOINT_DTYPE_CHOICES)
