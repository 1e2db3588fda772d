"""A QLoRA run as TRL's docs write one: the base loaded 4-bit with `BitsAndBytesConfig`
(nf4), `SFTTrainer(peft_config=LoraConfig(...))`, the adapter saved with `save_model`.

    python sft_qlora.py --model_name_or_path DIR --dataset_file data.jsonl --output_dir out

Nothing in it knows about LazyTrain: run it through `python -m lazytrain_accel.launch
sft_qlora.py --lazytrain ...` to train with it. `--probe_file` (for tests) saves, after
training, the packed base weights and the trained model's logits on a fixed prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, HfArgumentParser
from trl import SFTConfig, SFTTrainer

PROBE_PROMPT = "the cat sat on a mat and then it ran home"


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Local model directory."})
    dataset_file: str = field(metadata={"help": "JSONL of {\"text\": ...} records."})
    lora_rank: int = field(default=8)
    adapter_dtype: str | None = field(default=None, metadata={
        "help": "Cast the adapters to this dtype before training (TRL leaves them bf16)."})
    probe_file: str | None = field(default=None, metadata={
        "help": "Save the packed weights and the logits on PROBE_PROMPT here (torch.save)."})


def quantization_config() -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.float32)


def probe_logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROBE_PROMPT, return_tensors="pt").input_ids.to(model.device)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float().cpu()


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script_args, config = parser.parse_args_into_dataclasses()
    dataset = load_dataset("json", data_files=script_args.dataset_file, split="train")
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path,
                                                 quantization_config=quantization_config())
    peft_config = LoraConfig(r=script_args.lora_rank, lora_alpha=2 * script_args.lora_rank,
                             lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=peft_config)
    if script_args.adapter_dtype:
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.to(getattr(torch, script_args.adapter_dtype))
    trainer.train()
    trainer.save_model()  # the adapter only (PEFT)
    trainer.save_state()  # trainer_state.json: the log history
    if script_args.probe_file:
        packed = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                  if p.dtype == torch.uint8}  # before eval: bnb's CPU kernel may repack
        torch.save({"packed": packed, "logits": probe_logits(trainer.model, tokenizer)},
                   script_args.probe_file)


if __name__ == "__main__":
    main()
