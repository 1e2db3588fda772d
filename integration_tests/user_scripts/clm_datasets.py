"""A causal-LM fine-tuning script written the way transformers' example `run_clm.py` is:
argument dataclasses parsed by HfArgumentParser, `datasets` text files, tokenize, group the
texts into blocks, train with the stock Trainer, evaluate and report perplexity.

    python clm_datasets.py --model_name_or_path DIR --train_file train.txt \
        --validation_file validation.txt --block_size 32 --output_dir out --do_train --do_eval

Nothing in it knows about LazyTrain: run it through `python -m lazytrain_accel.launch
clm_datasets.py --lazytrain ...` to train with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Local model directory."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A .txt file, one text per line."})
    validation_file: str | None = field(default=None)
    block_size: int = field(default=32, metadata={"help": "Tokens per training block."})


def group_texts(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """Concatenate all texts and cut them into blocks of `block_size` (the rest dropped)."""
    joined = {k: list(chain(*examples[k])) for k in examples}
    total = (len(joined["input_ids"]) // block_size) * block_size
    out = {k: [t[i:i + block_size] for i in range(0, total, block_size)]
           for k, t in joined.items()}
    out["labels"] = [list(x) for x in out["input_ids"]]
    return out


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    files = {"train": data_args.train_file}
    if data_args.validation_file:
        files["validation"] = data_args.validation_file
    raw = load_dataset("text", data_files=files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True,
                        remove_columns=["text"])
    blocks = tokenized.map(lambda batch: group_texts(batch, data_args.block_size), batched=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=blocks["train"],
                      eval_dataset=blocks.get("validation"), processing_class=tokenizer,
                      data_collator=default_data_collator)
    metrics = {}
    if training_args.do_train:
        metrics.update(trainer.train().metrics)
        trainer.save_model()
        trainer.save_state()  # trainer_state.json: the log history
    if training_args.do_eval:
        evaluation = trainer.evaluate()
        evaluation["perplexity"] = math.exp(evaluation["eval_loss"])
        metrics.update(evaluation)
    Path(training_args.output_dir, "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
