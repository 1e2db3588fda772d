"""The demo's data: MetaMathQA-form word problems, an in-code tokenizer, collation and
exact-match evaluation. `python -m lazytrain_accel.data` regenerates the bundled file."""

from lazytrain_accel.data.arithmetic import (
    bundled_path,
    extract_answer,
    generate_problems,
    load_jsonl,
    split_train_eval,
    write_jsonl,
)

__all__ = ["bundled_path", "extract_answer", "generate_problems", "load_jsonl",
           "split_train_eval", "write_jsonl"]
