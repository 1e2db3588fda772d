"""Regenerate the bundled data set: ``python -m lazytrain_accel.data``."""

from lazytrain_accel.data.arithmetic import (
    BUNDLED_COUNT,
    BUNDLED_SEED,
    bundled_path,
    generate_problems,
    write_jsonl,
)

if __name__ == "__main__":
    write_jsonl(generate_problems(BUNDLED_COUNT, seed=BUNDLED_SEED), bundled_path())
    print(f"wrote {BUNDLED_COUNT} problems to {bundled_path()}")
