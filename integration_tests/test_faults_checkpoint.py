"""SIGKILL during `save_state` (a real kill of a real training process): the previous
checkpoint in the same directory stays loadable, with exactly the weights it had."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin

_COMMON = textwrap.dedent("""
    import hashlib, sys, time
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from lazytrain_accel import Accelerator, LazyTrainPlugin

    def build(tmp):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
        ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(1))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
        plugin = LazyTrainPlugin(plan="megatrain", hardware="h800",
                                 cache_dir=tmp + "/cache", nvme_dir=tmp + "/nvme")
        acc = Accelerator(cpu=True, plugin=plugin)
        return acc, *acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)

    def digest(model):
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest()
""")

_CHILD = _COMMON + textwrap.dedent("""
    tmp, ckpt = sys.argv[1], sys.argv[2]
    acc, model, opt, loader = build(tmp)
    for step, (batch,) in enumerate(loader):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
        if step == 1:
            acc.save_state(ckpt)
            print("SAVED", digest(model), flush=True)
        if step == 2:
            break
    stock_save = torch.save
    def slow_save(*args, **kwargs):  # the kill lands after the weights were written
        stock_save(*args, **kwargs)
        print("IN_SAVE", flush=True)
        time.sleep(600)
    torch.save = slow_save
    acc.save_state(ckpt)
    print("NOT KILLED", flush=True)
""")


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), str(ckpt)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saved = None
    try:
        for line in child.stdout:
            if line.startswith("SAVED"):
                saved = line.split()[1]
            if line.startswith("IN_SAVE"):
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.kill()
        _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err[-3000:]
    assert saved is not None, err[-3000:]
    # the kill came mid-save: a temp save sits beside the untouched checkpoint
    assert [p.name for p in tmp_path.glob(".ckpt.tmp-*")] == [f".ckpt.tmp-{child.pid}"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    fresh = _digest(model)
    ids = torch.zeros((4, 12), dtype=torch.long)
    acc = Accelerator(cpu=True, plugin=LazyTrainPlugin(
        plan="megatrain", hardware="h800", cache_dir=str(tmp_path / "cache"),
        nvme_dir=str(tmp_path / "nvme")))
    model, opt, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                torch.utils.data.DataLoader(
                                    torch.utils.data.TensorDataset(ids), batch_size=4))
    acc.load_state(str(ckpt))
    assert _digest(model) == saved != fresh
    assert opt.optimizer.state  # the optimizer state came back too
    assert not list(tmp_path.glob(".ckpt.*"))  # the dead save's temp was dropped
    acc.end_training()
