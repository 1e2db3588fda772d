"""Arithmetic word problems in MetaMathQA's form, generated deterministically.

Each record is ``{"query": ..., "response": ...}`` and the response ends with
``"The answer is: N"``, exactly like MetaMathQA, so a real MetaMathQA JSONL file can be
used in place of the bundled one. Operands are small on purpose: the demo must show a
tiny model going from no correct answers to many within a few CPU minutes, so the problems
exercise the format and a table of facts a small transformer can learn quickly.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path

#: File name of the bundled data set (package data of `lazytrain_accel.data`).
BUNDLED_FILE = "arithmetic_word_problems.jsonl"
#: Seed and size the bundled file was generated with (`python -m lazytrain_accel.data`).
BUNDLED_SEED = 1234
BUNDLED_COUNT = 6000

_NAMES = ("Tom", "Anna", "Li", "Maria", "Omar", "Sara", "Ken", "Julia", "Ravi", "Emma",
          "Noah", "Zoe")
_ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "stamps", "shells",
          "cards", "eggs")
_ANSWER_RE = re.compile(r"The answer is:\s*(-?[\d,]*\.?\d+)")


def _add(rng: random.Random, name: str, item: str, max_operand: int) -> tuple[str, str]:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    query = f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have?"
    return query, f"{name} has {a} + {b} = {a + b} {item}. The answer is: {a + b}"


def _sub(rng: random.Random, name: str, item: str, max_operand: int) -> tuple[str, str]:
    a = rng.randint(2, 2 * max_operand)
    b = rng.randint(1, a - 1)
    query = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
    return query, f"{name} has {a} - {b} = {a - b} {item} left. The answer is: {a - b}"


def _mul(rng: random.Random, name: str, item: str, max_operand: int) -> tuple[str, str]:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    query = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} in total?"
    return query, f"{name} buys {a} * {b} = {a * b} {item}. The answer is: {a * b}"


_TEMPLATES: tuple[Callable[[random.Random, str, str, int], tuple[str, str]], ...] = (
    _add, _sub, _mul)


def generate_problems(count: int, *, seed: int = BUNDLED_SEED,
                      max_operand: int = 9) -> list[dict[str, str]]:
    """`count` word problems; the same (count, seed, max_operand) always gives the same list."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    if max_operand < 2:
        raise ValueError(f"max_operand={max_operand} must be >= 2 (subtraction needs a >= 2)")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        template = rng.choice(_TEMPLATES)
        query, response = template(rng, rng.choice(_NAMES), rng.choice(_ITEMS), max_operand)
        records.append({"query": query, "response": response})
    return records


def extract_answer(text: str) -> str | None:
    """The N of the first "The answer is: N" in `text` (commas dropped), or None."""
    match = _ANSWER_RE.search(text)
    return match.group(1).replace(",", "") if match else None


def write_jsonl(records: Iterable[dict[str, str]], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


def load_jsonl(path: str | Path) -> list[dict[str, str]]:
    """Records of a MetaMathQA-form JSONL file; each must have string "query"/"response"
    and a response that states "The answer is: N" (the exact-match evaluation needs it)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:  # an input error: the CLI exits 2
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"cannot read the dataset {str(path)!r} ({reason}); pass a "
                         "MetaMathQA-form JSONL file or leave --dataset out for the bundled "
                         "problems") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not valid JSON ({err})") from None
        if not (isinstance(record, dict) and isinstance(record.get("query"), str)
                and isinstance(record.get("response"), str)):
            raise ValueError(f"{path}:{number} needs string fields 'query' and 'response' "
                             "(MetaMathQA form)")
        if extract_answer(record["response"]) is None:
            raise ValueError(f"{path}:{number}: response does not end with 'The answer "
                             "is: N'; exact-match evaluation needs that final line")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def bundled_path() -> Path:
    """Where the bundled data set lives inside the installed package."""
    return Path(str(resources.files("lazytrain_accel.data") / BUNDLED_FILE))


def split_train_eval(records: list[dict[str, str]], *,
                     eval_count: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The last `eval_count` records are held out for evaluation, the rest train.

    Held-out problems never appear in training; a query seen in training is removed from
    the evaluation split so that exact match measures more than recall.
    """
    if not 0 < eval_count < len(records):
        raise ValueError(f"eval_count={eval_count} must be between 1 and the number of "
                         f"records - 1 ({len(records) - 1})")
    train, held_out = records[:-eval_count], records[-eval_count:]
    seen = {r["query"] for r in train}
    return train, [r for r in held_out if r["query"] not in seen]
