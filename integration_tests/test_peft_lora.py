"""PEFT LoRA through the plugin and through the Trainer: frozen weights unchanged, optimizer
state only for the adapters, an adapter reload gives identical logits, stock parity."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.frontends.transformers import LazyTrainTrainer
from lazytrain_accel.optim import HybridAdamW8bit

VOCAB = 64


def _base(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False))


def _lora(base: torch.nn.Module) -> PeftModel:
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        lora_dropout=0.0, init_lora_weights=False)  # nonzero B: real grads
    return get_peft_model(base, config)


def _batches(num: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(num)]


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("optimizer", ["keep", "hybrid8bit"])
def test_lora_through_the_plugin(optimizer, tmp_path):
    ref = _lora(_base())
    model = copy.deepcopy(ref)
    frozen = _frozen(model)
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800", optimizer=optimizer,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, opt = acc.prepare(model, torch.optim.AdamW(trainable, lr=1e-2))
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for ids in _batches():
        ref(input_ids=ids, labels=ids).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    for name, before in frozen.items():
        assert torch.equal(dict(model.named_parameters())[name], before), name
    inner = opt.optimizer
    assert isinstance(inner, HybridAdamW8bit) == (optimizer == "hybrid8bit")
    assert {id(p) for p in inner.state} == {id(p) for p in trainable}  # adapters only
    tol = dict(rtol=1e-5, atol=1e-6) if optimizer == "keep" else dict(rtol=0.05, atol=2e-3)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, msg=name, **tol)
    _adapter_reload_gives_identical_logits(model, tmp_path)
    acc.end_training()


def _adapter_reload_gives_identical_logits(model: PeftModel, tmp_path: Path) -> None:
    ids = _batches(1)[0]
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=0)


class _Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = [row for batch in _batches(4) for row in batch]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train_with_trainer(tmp_path: Path, lazytrain: dict | None) -> tuple[list[float], PeftModel]:
    model = _lora(_base())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             max_steps=4, logging_steps=1, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_strategy="no", seed=0,
                             disable_tqdm=True)
    kwargs = {} if lazytrain is None else {"lazytrain_config": {
        "hardware": "h800", "cache_dir": str(tmp_path / "cache"), **lazytrain}}
    trainer = LazyTrainTrainer(model=model, args=args, train_dataset=_Rows(), **kwargs)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], model


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lora_through_the_trainer(tmp_path):
    stock, _ = _train_with_trainer(tmp_path / "stock", None)
    kept, kept_model = _train_with_trainer(tmp_path / "keep",
                                           {"plan": "megatrain", "optimizer": "keep"})
    assert kept == pytest.approx(stock, rel=1e-5, abs=1e-6)
    hybrid, _ = _train_with_trainer(tmp_path / "hybrid", {"plan": "offload_all"})
    assert hybrid[0] == pytest.approx(stock[0], rel=1e-5)
    assert hybrid[-1] == pytest.approx(stock[-1], rel=0.05)
    base = _frozen(_lora(_base()))
    for name, p in _frozen(kept_model).items():
        assert torch.equal(p, base[name]), name
    _adapter_reload_gives_identical_logits(kept_model, tmp_path)
