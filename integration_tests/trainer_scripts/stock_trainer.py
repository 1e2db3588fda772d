"""A Trainer script written only against stock transformers: no lazytrain_accel import.

Tiny Qwen2 from a config, a counting-sequence data set, HfArgumentParser over the stock
TrainingArguments plus one dataclass of its own. Writes the logged losses and the class
of the optimizer that stepped to --summary (JSON), so tests can compare launches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from transformers import (
    HfArgumentParser,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
    set_seed,
)


@dataclass
class ScriptArguments:
    summary: str = field(metadata={"help": "where to write the JSON summary"})
    num_samples: int = 64
    seq_len: int = 16


class CountingDataset(torch.utils.data.Dataset):
    """Each sequence counts upward from a random start (mod vocab): easy to learn."""

    def __init__(self, num_samples: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, vocab, (num_samples, 1), generator=g)
        self.ids = (start + torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    data = CountingDataset(script_args.num_samples, script_args.seq_len, config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    summary = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "optimizer": type(optimizer).__name__,
        "log_keys": sorted({k for e in trainer.state.log_history for k in e}),
    }
    if trainer.is_world_process_zero():
        with open(script_args.summary, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
