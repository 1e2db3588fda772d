"""Fine-tune a causal LM on MetaMathQA-form data with the HF Trainer, with or without LazyTrain.

    python examples/train_clm.py --output_dir out --max_steps 50 [--lazytrain]
    accelerate launch examples/train_clm.py --output_dir out --lazytrain \
        --lazytrain_config '{"plan": "auto"}' --dataset my_metamathqa.jsonl --bf16

`--model` is a local HF model directory (weights and tokenizer are loaded from it), a
config `.json` or a preset name such as `tiny-demo` (randomly initialised). A model
without its own tokenizer uses UTF-8 bytes as tokens. `--dataset` is a JSONL file of
`{"query", "response"}` records (MetaMathQA's form); without it the bundled arithmetic
word problems are used. Every other flag is a stock `TrainingArguments` flag.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    PreTrainedModel,
    TrainerCallback,
    set_seed,
)

from lazytrain_accel.frontends.transformers import (
    LazyTrainTrainer,
    LazyTrainTrainingArguments,
)

IGNORE_INDEX = -100  # label of positions the loss skips (prompt and padding)


@dataclass(kw_only=True)
class ModelArguments:
    model: str = field(default="tiny-demo", metadata={
        "help": "Local HF model directory, config .json, or preset name (e.g. tiny-demo)."})


@dataclass(kw_only=True)
class DataArguments:
    dataset: str | None = field(default=None, metadata={
        "help": "JSONL of {\"query\", \"response\"} records; default: the bundled set."})
    max_seq_len: int = field(default=128, metadata={
        "help": "Every sample is truncated/padded to this many tokens (one plan shape)."})
    max_samples: int | None = field(default=None, metadata={
        "help": "Use only the first N records."})


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, then end-of-text and padding."""

    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_model(spec: str) -> tuple[PreTrainedModel, Any]:
    """The model and its tokenizer (a `ByteTokenizer` when the model has none)."""
    path = Path(spec)
    if path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        from lazytrain_accel.profiling.model_configs import load_model_config

        config_dict = load_model_config(spec)
        config = AutoConfig.for_model(**config_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = ByteTokenizer()
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model {spec!r} has vocab_size {model.config.vocab_size}; the byte "
                             f"tokenizer needs >= {tokenizer.vocab_size}. Give a model "
                             "directory with its own tokenizer or a larger vocabulary.")
    return model, tokenizer


def read_records(path: str | None, max_samples: int | None) -> list[dict[str, str]]:
    if path is None:
        from lazytrain_accel.data.arithmetic import bundled_path

        path = str(bundled_path())
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("query"), str) or not isinstance(
                    record.get("response"), str):
                raise ValueError(f"{path}:{number}: each record needs string 'query' and "
                                 "'response' fields (MetaMathQA form)")
            records.append(record)
            if max_samples is not None and len(records) >= max_samples:
                break
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def encode(record: dict[str, str], tokenizer: Any, seq_len: int) -> dict[str, torch.Tensor]:
    """Prompt (query + newline) then response + end token; only the response is learned."""
    prompt = tokenizer.encode(record["query"] + "\n")
    answer = [*tokenizer.encode(record["response"]), tokenizer.eos_token_id]
    ids = (prompt + answer)[:seq_len]
    labels = ([IGNORE_INDEX] * len(prompt) + answer)[:seq_len]
    pad = seq_len - len(ids)
    return {
        "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
        "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
        "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
    }


def main(argv: Sequence[str] | None = None,
         callbacks: Sequence[TrainerCallback] = ()) -> LazyTrainTrainer:
    """Parse `argv` (default: the command line), train, save; return the trainer."""
    parser = HfArgumentParser((ModelArguments, DataArguments, LazyTrainTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(
        args=list(argv) if argv is not None else sys.argv[1:])
    set_seed(training_args.seed)  # the model's initialisation must not depend on the run
    model, tokenizer = load_model(model_args.model)
    records = read_records(data_args.dataset, data_args.max_samples)
    dataset = [encode(r, tokenizer, data_args.max_seq_len) for r in records]
    trainer = LazyTrainTrainer(model=model, args=training_args, train_dataset=dataset,
                               callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    main()
