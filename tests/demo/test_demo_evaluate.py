"""Exact match counts the answers a model generates, from left-padded batches."""

from __future__ import annotations

import torch
from torch import nn

from lazytrain_accel.data.arithmetic import generate_problems
from lazytrain_accel.data.collate import prompt_of
from lazytrain_accel.data.evaluate import exact_match
from lazytrain_accel.data.tokenizer import build_demo_tokenizer

RECORDS = generate_problems(12, seed=5)
TOKENIZER = build_demo_tokenizer([r["query"] + "\n" + r["response"] for r in RECORDS])


class LookupModel(nn.Module):
    """Answers each prompt from a table, after checking the batch is left-padded: every
    row's prompt must end at the last column, where generation appends."""

    def __init__(self, answers: dict[str, str]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.answers = answers
        self.batch_sizes: list[int] = []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int, **_: object) -> torch.Tensor:
        assert torch.all(attention_mask[:, -1] == 1), "prompts must be left-padded"
        self.batch_sizes.append(len(input_ids))
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            prompt = TOKENIZER.decode(ids[mask.bool()])
            new = TOKENIZER(self.answers[prompt], add_special_tokens=False)["input_ids"]
            new = [*new, TOKENIZER.eos_token_id][:max_new_tokens]
            new += [TOKENIZER.pad_token_id] * (max_new_tokens - len(new))
            rows.append(torch.cat([ids, torch.tensor(new)]))
        return torch.stack(rows)


def test_counts_correct_answers_across_batches() -> None:
    answers = {prompt_of(r): r["response"] for r in RECORDS}
    wrong = RECORDS[:4]
    for r in wrong:  # same text, answer off by one
        n = int(r["response"].rsplit(": ", 1)[1])
        answers[prompt_of(r)] = f"Tom has {n + 1} apples. The answer is: {n + 1}"
    model = LookupModel(answers)
    result = exact_match(model, TOKENIZER, RECORDS, batch_size=5, max_new_tokens=40)
    assert (result.correct, result.total) == (len(RECORDS) - len(wrong), len(RECORDS))
    assert result.exact_match == (len(RECORDS) - len(wrong)) / len(RECORDS)
    assert model.batch_sizes == [5, 5, 2]
    # The first three wrong and the first three right problems, labelled, in record order.
    assert [(s.query, s.correct) for s in result.samples] == [
        *[(r["query"], False) for r in RECORDS[:3]], *[(r["query"], True) for r in RECORDS[4:7]]]
    first_right = result.samples[3]
    assert first_right.generated == answers[prompt_of(RECORDS[4])]
    assert first_right.expected == RECORDS[4]["response"].rsplit(": ", 1)[1]
    assert model.training  # restored after evaluating


def test_a_cut_off_answer_is_not_a_match() -> None:
    answers = {prompt_of(r): r["response"] for r in RECORDS}
    result = exact_match(LookupModel(answers), TOKENIZER, RECORDS, max_new_tokens=3)
    assert result.correct == 0
