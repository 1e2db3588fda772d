"""QLoRA through the plugin (issue 17 item 3): a tiny Llama whose linears are bitsandbytes
nf4 (quantized on this CPU, no download) under PEFT LoRA adapters trains through the plugin,
optimizer kept, exactly as through stock Accelerate; packed frozen weights are never cast
to float masters and come out bit-identical; the saved adapter reloads onto a freshly
quantized base with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from qa_helpers import VOCAB, build, padded_samples, plugin, train

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # bnb's CPU kernel notes

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _wide_llama(hidden_size: int = 64) -> torch.nn.Module:
    """A Llama whose linears are at least one 4-bit block (64) wide: bitsandbytes' CPU
    eval kernel repacks weights per 64 input features and fails on narrower ones."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size,
                                      intermediate_size=2 * hidden_size,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, max_position_embeddings=64,
                                      use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def quantized_base(quant_type: str = "nf4", wide: bool = False,
                   hidden_size: int = 64) -> torch.nn.Module:
    """A tiny Llama with every decoder linear replaced by a bitsandbytes 4-bit one
    (what `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` loads)."""
    model = _wide_llama(hidden_size) if wide else build("llama")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(linear.in_features, linear.out_features,
                                      bias=linear.bias is not None,
                                      compute_dtype=torch.float32, quant_type=quant_type)
                q.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False,
                                             quant_type=quant_type)
                setattr(parent, name, q.to("cpu"))
    return model


def qlora(quant_type: str = "nf4", wide: bool = False, hidden_size: int = 64) -> torch.nn.Module:
    return peft.get_peft_model(quantized_base(quant_type, wide, hidden_size), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))


def _packed(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p for n, p in params.items() if p.dtype == torch.uint8}


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_qlora_trains_like_stock_accelerate_step_for_step(tmp_path: Path,
                                                          quant_type: str) -> None:
    stock = train(qlora(quant_type), None)
    ours = train(qlora(quant_type), plugin(tmp_path, "megatrain", optimizer="keep"))
    assert ours.losses == stock.losses and ours.grad_norms == stock.grad_norms
    assert ours.params.keys() == stock.params.keys()
    for name, value in stock.params.items():
        assert ours.params[name].dtype == value.dtype, name  # packed stays uint8
        torch.testing.assert_close(ours.params[name], value, rtol=0, atol=0, msg=name)
    packed = _packed(ours.params)
    assert len(packed) == 4 * 7  # every linear of the 4 layers
    fresh = _packed({n: p.detach() for n, p in qlora(quant_type).named_parameters()})
    for name, value in packed.items():  # frozen: bit-identical to a fresh quantization
        assert torch.equal(value, fresh[name]), name
    trained = [n for n in ours.params if "lora_" in n]
    initial = dict(qlora(quant_type).named_parameters())
    assert trained and all(not torch.equal(ours.params[n], initial[n]) for n in trained
                           if "lora_B" in n)


def test_saved_adapter_reloads_onto_a_fresh_base_with_the_same_logits(tmp_path: Path) -> None:
    from lazytrain_accel import Accelerator

    model = qlora(wide=True)
    acc = Accelerator(cpu=True, plugin=plugin(tmp_path, "offload_all", optimizer="keep"))
    model, opt, loader = acc.prepare(
        model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        torch.utils.data.DataLoader(padded_samples(), batch_size=2))
    for batch in loader:
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
    prompt = padded_samples()[0]["input_ids"][None, :8]
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=prompt).logits
    acc.unwrap_model(model).save_pretrained(tmp_path / "adapter")
    acc.end_training()
    reloaded = peft.PeftModel.from_pretrained(quantized_base(wide=True),
                                              tmp_path / "adapter").eval()
    with torch.no_grad():
        logits = reloaded(input_ids=prompt).logits
    torch.testing.assert_close(logits, ours, rtol=0, atol=0)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size > 0


def test_the_plan_prices_the_packed_base(tmp_path: Path) -> None:
    from lazytrain_accel.run import setup
    model = qlora()
    profile = setup.profile_for_run(model, batch_size=2, seq_len=12, compute_dtype=None)
    w = profile.weights
    attention, mlp = 2 * 32 * 32 + 2 * 32 * 16, 3 * 32 * 64  # hidden 32, kv 16, mlp 64
    assert w.frozen_format == "nf4" and w.layer_packed_param_count == attention + mlp
    assert profile.layer_grad_bytes == 4 * w.layer_trainable_param_count  # fp32 compute
    floats = w.layer_frozen_param_count - w.layer_packed_param_count  # norms
    assert profile.layer_param_bytes == (w.layer_packed_bytes + 4 * floats
                                         + 4 * w.layer_trainable_param_count)
    # packed: half a byte per weight + scales (+ 64 B of code per tensor at this tiny size)
    assert w.layer_packed_bytes < 0.4 * 4 * w.layer_packed_param_count


def test_lora_on_a_bf16_base_keeps_the_frozen_weights_bf16_on_the_host(tmp_path: Path) -> None:
    """Frozen float weights stay as stored (2 bytes each, not an fp32 master): what the
    planner charges for them. Adapters keep fp32 masters and train as in a stock run."""
    from lazytrain_accel import Accelerator

    def lora_bf16() -> torch.nn.Module:
        return peft.get_peft_model(build("llama").to(torch.bfloat16), peft.LoraConfig(
            r=4, target_modules=TARGETS, lora_dropout=0.0))  # adapters in fp32 (PEFT)

    runs = {}
    for name, extra in (("stock", {}), ("ours", {"plugin": plugin(tmp_path, "megatrain",
                                                                   optimizer="keep")})):
        model = lora_bf16()
        acc = Accelerator(cpu=True, mixed_precision="bf16", **extra)
        model, opt, loader = acc.prepare(
            model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                     lr=1e-2),
            torch.utils.data.DataLoader(padded_samples(), batch_size=2))
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}
        runs[name] = losses, params
        acc.end_training()
    (ours, ours_params), (stock, stock_params) = runs["ours"], runs["stock"]
    assert ours == pytest.approx(stock, rel=2e-2)  # bf16 compute: within bf16 tolerance
    initial = dict(lora_bf16().named_parameters())
    for name, value in ours_params.items():
        assert value.dtype == stock_params[name].dtype, name
        if "lora_" not in name:
            assert value.dtype == torch.bfloat16 and torch.equal(value, initial[name]), name


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in padded_samples()[i].items()}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_qlora_through_the_trainer_matches_the_stock_trainer(tmp_path: Path) -> None:
    from lazytrain_accel.frontends.transformers import LazyTrainTrainer

    def args(name: str) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / name), use_cpu=True, report_to="none", max_steps=3,
            save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-2,
            per_device_train_batch_size=2, seed=0, data_seed=0)

    stock = transformers.Trainer(model=qlora(), args=args("stock"), train_dataset=_Rows())
    stock.train()
    ours = LazyTrainTrainer(model=qlora(), args=args("ours"), train_dataset=_Rows(),
                            lazytrain_config={"plan": "megatrain", "hardware": "h800",
                                              "optimizer": "keep",
                                              "cache_dir": str(tmp_path / "cache")})
    ours.train()

    def losses(trainer: transformers.Trainer) -> list[float]:
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    assert losses(ours) == losses(stock) and len(losses(stock)) == 3
    trained = dict(stock.model.named_parameters())
    for name, value in ours.model.named_parameters():
        torch.testing.assert_close(value.detach(), trained[name].detach(), rtol=0, atol=0,
                                   msg=name)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_frozen_weights_quantizes_a_full_precision_base_at_prepare(tmp_path: Path,
                                                                   fmt: str) -> None:
    """`frozen_weights="nf4"` / `"int8"` on a full-precision LoRA model packs its frozen
    linears as bitsandbytes does (the bytes of a by-hand quantization) and trains exactly
    like stock Accelerate on the same quantized model."""
    from lazytrain_accel.engine.memory.quantize_base import quantize_frozen_linears

    def full_precision() -> torch.nn.Module:
        return peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=TARGETS,
                                                                   lora_dropout=0.0))

    reference = full_precision()
    assert quantize_frozen_linears(reference, fmt) == 4 * 7
    stock = train(reference, None)
    ours = train(full_precision(), plugin(tmp_path, "megatrain", optimizer="keep",
                                          frozen_weights=fmt))
    assert ours.losses == stock.losses
    assert ours.params.keys() == stock.params.keys()
    for name, value in stock.params.items():
        torch.testing.assert_close(ours.params[name], value, rtol=0, atol=0, msg=name)
    packed = {n: p for n, p in ours.params.items() if p.dtype in (torch.uint8, torch.int8)}
    assert len(packed) == 4 * 7
    weight = build("llama").model.layers[0].mlp.up_proj.weight.data
    by_hand = (bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
               if fmt == "int8" else bnb.nn.Params4bit(weight, requires_grad=False,
                                                        quant_type=fmt,
                                                        compress_statistics=False)).to("cpu")
    name = next(n for n in packed if "layers.0.mlp.up_proj" in n)
    assert torch.equal(packed[name], by_hand.data)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trl_sft_trainer_with_peft_config_matches_stock(tmp_path: Path) -> None:
    """TRL's `SFTTrainer(peft_config=...)` on the nf4 base, made a LazyTrain run with
    `apply_lazytrain_to_trainer` (what the launcher's `--lazytrain` does to every Trainer):
    the same losses and adapters as the stock SFTTrainer (fp32: SFTConfig's bf16 off)."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from lazytrain_accel.data.tokenizer import build_demo_tokenizer
    from lazytrain_accel.frontends.transformers import apply_lazytrain_to_trainer

    texts = [f"{a} plus {b} is {a + b}" for a in range(8) for b in range(2)]
    tokenizer = build_demo_tokenizer(texts)

    def model() -> torch.nn.Module:
        base = quantized_base()
        torch.manual_seed(0)  # the new embedding rows: the same in both runs
        base.resize_token_embeddings(len(tokenizer))
        return base

    def run(name: str, lazytrain: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        args = trl.SFTConfig(output_dir=str(tmp_path / name), use_cpu=True, report_to="none",
                             max_steps=3, save_strategy="no", logging_steps=1,
                             disable_tqdm=True, learning_rate=1e-2, bf16=False,
                             per_device_train_batch_size=2, seed=0, data_seed=0,
                             max_length=16)
        trainer = trl.SFTTrainer(
            model=model(), args=args, processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_dict({"text": texts}),
            peft_config=peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
        if lazytrain:
            apply_lazytrain_to_trainer(trainer, {
                "plan": "megatrain", "hardware": "h800", "optimizer": "keep",
                "cache_dir": str(tmp_path / "cache")})
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return losses, {n: p.detach() for n, p in trainer.model.named_parameters()}

    (stock, stock_params), (ours, ours_params) = run("stock", False), run("ours", True)
    assert ours == stock and len(stock) == 3
    for name, value in stock_params.items():
        torch.testing.assert_close(ours_params[name], value, rtol=0, atol=0, msg=name)


def test_qlora_trained_in_eval_mode_runs_the_stock_cpu_kernels(tmp_path: Path) -> None:
    """`from_pretrained` returns an eval-mode model, and short scripts train it so. In eval
    mode bitsandbytes' `Linear4bit` on a CPU with AVX512-BF16 repacks its weight for the
    inference kernel at a call whose input needs no grad (stock: layer 1's q/k/v, fed by
    the frozen embeddings) and uses that kernel from then on. The streamed layers, which
    run their forward without a graph, must take the same branch for the same linears:
    losses, adapters and the (repacked) packed weights equal stock's."""
    if not bnb.functional.has_avx512bf16():
        pytest.skip("no AVX512-BF16 on this CPU: bitsandbytes has no CPU inference kernel")
    stock = train(qlora(wide=True).eval(), None)
    ours = train(qlora(wide=True).eval(), plugin(tmp_path, "megatrain", optimizer="keep"))
    repacked = {n for n, v in _packed(stock.params).items() if v.shape[1] != 1}
    assert 0 < len(repacked) < len(_packed(stock.params))  # the test sees both branches
    assert ours.losses == stock.losses and ours.grad_norms == stock.grad_norms
    assert ours.params.keys() == stock.params.keys()
    for name, value in stock.params.items():
        torch.testing.assert_close(ours.params[name], value, rtol=0, atol=0, msg=name)
