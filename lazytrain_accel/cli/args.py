"""Flag types and flags several subcommands share, so a bad value reads the same in all.

Light on purpose (argparse only): every subcommand's parser imports it.
"""

from __future__ import annotations

import argparse


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """argparse type of counts and sizes (`--batch-size`, `--seq-len`, `--steps`): >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type of settings where 0 means "off" (`--loss-chunk-tokens`): >= 0."""
    return _int_at_least(text, 0)


def add_loss_chunk_arg(p: argparse.ArgumentParser, *, default: int | None = 0) -> None:
    """`--loss-chunk-tokens`: the head's working bytes the planner counts."""
    shown = "" if default is None else f" (default {default})"
    p.add_argument("--loss-chunk-tokens", type=non_negative_int, default=default, metavar="N",
                   help="the fused chunked loss with N tokens of logits at a time "
                   "(LazyTrainConfig.loss_chunk_tokens); 0 = the model's own loss, full "
                   f"tokens x vocab logits{shown}")
