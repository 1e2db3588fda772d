"""Exact-match accuracy by greedy generation: is the generated "The answer is: N" right?"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lazytrain_accel.data.arithmetic import extract_answer
from lazytrain_accel.data.collate import prompt_of


@dataclass(kw_only=True)
class Sample:
    """One evaluated problem: what the model was asked, what it wrote, and whether the
    answer it stated is the reference one."""

    query: str
    generated: str
    expected: str
    correct: bool


@dataclass(kw_only=True)
class EvalResult:
    correct: int
    total: int
    samples: list[Sample]  # the first few right and the first few wrong, in record order

    @property
    def exact_match(self) -> float:
        return self.correct / self.total


@torch.no_grad()
def exact_match(model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                records: list[dict[str, str]], *, batch_size: int = 64,
                max_new_tokens: int = 32, device: torch.device | None = None,
                keep_samples: int = 3) -> EvalResult:
    """Greedy-generate a response to every record's query (left-padded batches) and count
    the records whose generated answer equals the reference answer. `samples` keeps the
    first `keep_samples` right and the first `keep_samples` wrong problems."""
    if not records:
        raise ValueError("exact_match needs at least one record to evaluate")
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"  # generation appends on the right of every row
    correct = 0
    samples: list[Sample] = []
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start:start + batch_size]
            texts = _generate(model, tokenizer, [prompt_of(r) for r in chunk],
                              max_new_tokens=max_new_tokens, device=device)
            for record, text in zip(chunk, texts, strict=True):
                expected = extract_answer(record["response"])
                right = expected is not None and extract_answer(text) == expected
                correct += int(right)
                if sum(s.correct == right for s in samples) < keep_samples:
                    samples.append(Sample(query=record["query"], generated=text,
                                          expected=expected or "", correct=right))
    finally:
        model.train(was_training)
    return EvalResult(correct=correct, total=len(records), samples=samples)


def _generate(model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[str], *,
              max_new_tokens: int, device: torch.device) -> list[str]:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    batch = {k: v.to(device) for k, v in batch.items()}
    output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, use_cache=True)
    new_tokens = output[:, batch["input_ids"].shape[1]:]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
