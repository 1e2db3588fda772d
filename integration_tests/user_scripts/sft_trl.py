"""A TRL supervised fine-tuning script with TRL's default `SFTConfig` (gradient
checkpointing on, padding each batch to its longest row), as TRL's own examples are.

    python sft_trl.py --model_name_or_path DIR --dataset_file data.jsonl --output_dir out

Nothing in it knows about LazyTrain: run it through `python -m lazytrain_accel.launch
sft_trl.py --lazytrain ...` to train with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Local model directory."})
    dataset_file: str = field(metadata={"help": "JSONL of {\"text\": ...} records."})


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script_args, config = parser.parse_args_into_dataclasses()
    dataset = load_dataset("json", data_files=script_args.dataset_file, split="train")
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: the log history


if __name__ == "__main__":
    main()
