"""A Trainer script written only against stock transformers: no lazytrain_accel import.

Tiny Qwen2 from a config, a counting-sequence data set, HfArgumentParser over the stock
TrainingArguments plus one dataclass of its own. Writes the logged losses and the class
of the optimizer that stepped to --summary (JSON), so tests can compare launches.
`--rank_out PREFIX` writes each rank's proportional set size (/proc/self/smaps_rollup)
with the runtime loaded and no model yet ("runtime": a first Trainer of a one-weight
model prepares a loader, which starts the process group and the loader workers' share)
and after training, and what the accelerator it ran with reports (read
with getattr: this script knows nothing of LazyTrain; "device": an engine's device bytes,
on a CPU device host pages that stand for GPU memory), to PREFIX<rank>.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    HfArgumentParser,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
    set_seed,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peak_rss import pss_bytes  # bench/ is not a package


@dataclass
class ScriptArguments:
    summary: str = field(metadata={"help": "where to write the JSON summary"})
    num_samples: int = 64
    seq_len: int = 16
    hidden_size: int = 64
    rank_out: str | None = None
    save_final: str | None = field(default=None, metadata={
        "help": "trainer.save_model() here after training (every rank)"})


def weights_digest(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> str:
    """sha256 of every parameter's bytes (`values`: the model's state dict as the
    accelerator gathers it), in order: equal exactly when bit-identical."""
    digest = hashlib.sha256()
    for name, _ in model.named_parameters():
        digest.update(name.encode())
        digest.update(values[name].detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


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
    pss_runtime = None
    if script_args.rank_out:  # the runtime first, then the model (as accelerate_train.py)
        runtime_data = CountingDataset(8, script_args.seq_len, 128)
        Trainer(model=torch.nn.Linear(1, 1), args=training_args,
                train_dataset=runtime_data).get_train_dataloader()
        pss_runtime = pss_bytes()
    set_seed(training_args.seed)
    hidden = script_args.hidden_size
    config = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    data = CountingDataset(script_args.num_samples, script_args.seq_len, config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if script_args.save_final:
        trainer.save_model(script_args.save_final)
    if script_args.rank_out:
        end = pss_bytes()  # the training state, before the state dict below
        # every rank: a collective where no node holds every weight (split layout, bf16)
        values = trainer.accelerator.get_state_dict(trainer.model)
        accelerator = trainer.accelerator
        lazytrain = getattr(accelerator, "lazytrain", None)  # None: the stock Trainer
        run = lazytrain.run if lazytrain is not None else None
        engine = lazytrain.engine if lazytrain is not None else None
        with open(f"{script_args.rank_out}{training_args.process_index}.json", "w") as f:
            json.dump({"runtime": pss_runtime, "end": end,
                       "device": engine.stats().current_bytes["device"]
                       if engine is not None and engine.device.type == "cpu" else 0,
                       "world_size": training_args.world_size,
                       "node_store": lazytrain is not None and lazytrain.store is not None,
                       "gpus_per_node": run.plan.gpus_per_node if run is not None else None,
                       "weights_sum": sum(float(values[n].detach().double().sum())
                                          for n, _ in model.named_parameters()),
                       "weights_sha256": weights_digest(model, values)}, f)
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
