"""Recompute the demo's exact-match figure from its output with plain transformers.

    python examples/reproduce_exact_match.py lazytrain_output

Loads `checkpoint/` with `AutoTokenizer` and `AutoModelForCausalLM` (no lazytrain_accel
import), greedily answers every problem of `eval_problems.jsonl` the way the demo does
(prompt = query + newline, left-padded batches of 64), and prints one JSON object: the
exact match recomputed here, the one `demo_summary.json` reports, and the answers.
After a CPU run (fp32) the two are equal; a GPU run evaluates through bf16 layer copies,
so a few greedy answers, and the figure, may differ from this fp32 recomputation.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ANSWER = re.compile(r"The answer is:\s*(-?[\d,]*\.?\d+)")
BATCH = 64


def answer_of(text: str) -> str | None:
    match = ANSWER.search(text)
    return match.group(1).replace(",", "") if match else None


@torch.no_grad()
def generate(model, tokenizer, queries: list[str], max_new_tokens: int) -> list[str]:
    tokenizer.padding_side = "left"
    texts = []
    for start in range(0, len(queries), BATCH):
        prompts = [q.strip() + "\n" for q in queries[start:start + BATCH]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        new_tokens = out[:, batch["input_ids"].shape[1]:]
        texts += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return texts


def main(output_dir: str) -> dict:
    out = Path(output_dir)
    summary = json.loads((out / "demo_summary.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out / "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint", dtype=torch.float32)
    model.eval()
    problems = [json.loads(line) for line in (out / "eval_problems.jsonl").open()]
    texts = generate(model, tokenizer, [p["query"] for p in problems],
                     summary["max_new_tokens"])
    pairs = list(zip(problems, texts, strict=True))
    right = sum(answer_of(t) == answer_of(p["response"]) for p, t in pairs)
    return {"exact_match": right / len(problems), "reported": summary["exact_match_after"],
            "answers": {p["query"]: t for p, t in pairs}}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "lazytrain_output")))
