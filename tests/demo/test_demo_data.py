"""The generated word problems: deterministic, correct, MetaMathQA-shaped, bundled as generated."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lazytrain_accel.data.arithmetic import (
    BUNDLED_COUNT,
    BUNDLED_SEED,
    bundled_path,
    extract_answer,
    generate_problems,
    load_jsonl,
    split_train_eval,
    write_jsonl,
)

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def test_same_seed_same_problems_and_other_seed_differs() -> None:
    assert generate_problems(50, seed=7) == generate_problems(50, seed=7)
    assert generate_problems(50, seed=7) != generate_problems(50, seed=8)


def test_every_response_states_the_right_answer_of_its_own_query() -> None:
    for record in generate_problems(500, seed=3, max_operand=12):
        a, op, b, result = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)", record["response"]).groups()
        assert _OPS[op](int(a), int(b)) == int(result) >= 0
        assert extract_answer(record["response"]) == result
        assert record["response"].endswith(f"The answer is: {result}")
        # The operands come from the query, in order: the response reasons about it.
        numbers = re.findall(r"\d+", record["query"])
        assert numbers == [a, b]


def test_bundled_file_is_exactly_what_the_generator_writes() -> None:
    assert load_jsonl(bundled_path()) == generate_problems(BUNDLED_COUNT, seed=BUNDLED_SEED)


def test_split_holds_out_the_tail_and_drops_queries_seen_in_training() -> None:
    records = [{"query": f"q{i % 30}", "response": "The answer is: 1"} for i in range(40)]
    train, held_out = split_train_eval(records, eval_count=15)
    assert len(train) == 25
    assert {r["query"] for r in held_out}.isdisjoint(r["query"] for r in train)
    assert [r["query"] for r in held_out] == [f"q{i}" for i in range(25, 30)]
    with pytest.raises(ValueError, match="eval_count=40"):
        split_train_eval(records, eval_count=40)


@pytest.mark.parametrize(("text", "expected"), [
    ("so 3 + 4 = 7. The answer is: 7", "7"),
    ("The answer is: 1,234", "1234"),
    ("The answer is:-2.5 and more", "-2.5"),
    ("The answer is unknown", None),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_load_jsonl_names_the_bad_line(tmp_path: Path) -> None:
    good = {"query": "q", "response": "The answer is: 3"}
    path = tmp_path / "d.jsonl"
    write_jsonl([good], path)
    assert load_jsonl(path) == [good]
    path.write_text(json.dumps(good) + "\n" + json.dumps({"query": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2 needs string fields"):
        load_jsonl(path)
    path.write_text(json.dumps({"query": "q", "response": "four"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: response does not end"):
        load_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1 is not valid JSON"):
        load_jsonl(path)
