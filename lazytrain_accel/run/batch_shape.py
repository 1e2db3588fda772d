"""The micro-batch shape a plan is sized for: the longest batch the run can produce.

In order: the config's explicit `seq_len`/`batch_size`; a sequence bound the run states
(TRL's `max_length`/`max_seq_length`, a collator padding to `max_length`), rounded up to
the collator's `pad_to_multiple_of`; else the first batch of the DataLoader. Without a
DataLoader and without explicit fields the shape is provisional: nothing is printed for
it and the engine re-plans for the first batch it sees. A batch longer than the plan
(dynamic padding) re-plans once upward, to the next power of two of its length capped by
what bounds the run (the tokenizer's `model_max_length`, the model's positions), before
that batch runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from lazytrain_accel.config import LazyTrainConfig

logger = logging.getLogger("lazytrain_accel")

#: Training-argument names of a sequence bound (TRL's SFTConfig; older TRL first).
_ARG_BOUNDS = ("max_seq_length", "max_length")


@dataclass(kw_only=True, frozen=True)
class Sizing:
    batch_size: int
    seq_len: int
    source: str  # what the shape came from, for the plan summary
    provisional: bool = False  # no one asked for this shape: re-plan at the first batch
    seq_cap: int = 0  # the longest sequence the run can produce (0 = unknown)


def _round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple and multiple > 1 else n


def _positive(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) \
        and 0 < value < 10**7 else None  # tokenizers say 1e30 for "no limit"


def _collator_bound(collate_fn: Any) -> int | None:
    if getattr(collate_fn, "padding", None) == "max_length":
        return _positive(getattr(collate_fn, "max_length", None))
    return None


def _seq_cap(model: nn.Module, collate_fn: Any, bound: int | None) -> int:
    """The longest sequence the run can produce: its bound, else the tokenizer's limit
    capped by the model's positions, else the model's positions (0 if none of them)."""
    positions = _positive(getattr(getattr(model, "config", None), "max_position_embeddings",
                                  None))
    tokenizer = getattr(collate_fn, "tokenizer", None) or getattr(collate_fn,
                                                                  "processing_class", None)
    limits = [n for n in (bound, _positive(getattr(tokenizer, "model_max_length", None)),
                          positions) if n]
    return bound or (min(limits) if limits else 0)


def _first_batch(loader: Any) -> tuple[int, int] | None:
    """(batch, seq) of one batch built without touching the sampler's RNG, or None."""
    batch_size = int(loader.batch_size or 1)
    try:
        dataset = loader.dataset
        samples = [dataset[i] for i in range(min(batch_size, len(dataset)))]
        batch = loader.collate_fn(samples)
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        return batch_size, int(ids.shape[-1])
    except Exception as err:  # iterable datasets, custom batches: size from the first step
        logger.info("lazytrain: could not read a batch to size the plan (%s); sizing it from "
                    "the first training batch", err)
        return None


def size_run(loader: Any, model: nn.Module, config: LazyTrainConfig, *,
             seq_bound: int | None = None) -> Sizing:
    """The shape to plan for. `seq_bound`: a sequence bound the front end knows (the
    Trainer passes TRL's `max_length`)."""
    collate_fn = getattr(loader, "collate_fn", None)
    multiple = _positive(getattr(collate_fn, "pad_to_multiple_of", None))
    bound = _positive(seq_bound) or _collator_bound(collate_fn)
    bound = _round_up(bound, multiple) if bound else None
    cap = _seq_cap(model, collate_fn, bound)
    loader_batch = int(getattr(loader, "batch_size", 0) or 0) if loader is not None else 0
    batch = config.batch_size or loader_batch or 1
    if config.seq_len:
        return Sizing(batch_size=batch, seq_len=config.seq_len, source="seq_len setting",
                      seq_cap=max(cap, config.seq_len))
    if bound:
        return Sizing(batch_size=batch, seq_len=bound, source="the run's sequence bound",
                      seq_cap=bound)
    first = _first_batch(loader) if loader is not None else None
    if first is None:
        return Sizing(batch_size=config.batch_size or 1, seq_len=1, provisional=True,
                      source="provisional", seq_cap=cap)
    return Sizing(batch_size=config.batch_size or first[0], seq_len=first[1],
                  source="the first batch", seq_cap=cap)


def seq_bound_of(args: Any) -> int | None:
    """A sequence bound stated in (TRL's) training arguments, or None."""
    for name in _ARG_BOUNDS:
        bound = _positive(getattr(args, name, None))
        if bound:
            return bound
    return None


def grown(sizing: Sizing, batch_size: int, seq_len: int) -> Sizing:
    """The shape to re-plan for when a (batch, seq) batch exceeds `sizing`'s tokens:
    exactly it after a provisional shape, else the next power of two of its length
    capped by the run's longest sequence (one re-plan covers the batches after it)."""
    batch = max(batch_size, sizing.batch_size)
    if sizing.provisional:
        return Sizing(batch_size=batch_size, seq_len=seq_len, source="the first batch",
                      seq_cap=sizing.seq_cap)
    target = 1 << max(seq_len - 1, 0).bit_length()
    if sizing.seq_cap:
        target = min(target, sizing.seq_cap)
    return Sizing(batch_size=batch, seq_len=max(target, seq_len, sizing.seq_len),
                  source="a longer batch", seq_cap=max(sizing.seq_cap, seq_len))
