"""What the plan is sized for: explicit fields, the run's sequence bound, the first batch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lazytrain_accel import LazyTrainPlugin
from lazytrain_accel.run.batch_shape import Sizing, grown, seq_bound_of, size_run

_MODEL = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))


class _Collator:
    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)

    def __call__(self, rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)}


def _loader(collate_fn: _Collator, lengths: tuple[int, ...] = (34, 20)) -> object:
    rows = [torch.ones(n, dtype=torch.long) for n in lengths]
    return torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate_fn)


def _config(**kwargs: int) -> LazyTrainPlugin:
    return LazyTrainPlugin(plan="checkpoint_all", hardware="h800", **kwargs)


def test_the_first_batch_sizes_a_dynamically_padded_run_capped_by_the_tokenizer():
    tokenizer = SimpleNamespace(model_max_length=512)
    sizing = size_run(_loader(_Collator(tokenizer=tokenizer)), _MODEL, _config())
    assert (sizing.batch_size, sizing.seq_len, sizing.seq_cap) == (2, 34, 512)
    assert not sizing.provisional
    no_limit = SimpleNamespace(model_max_length=int(1e30))  # tokenizers' "no limit"
    assert size_run(_loader(_Collator(tokenizer=no_limit)), _MODEL, _config()).seq_cap == 4096


def test_a_stated_bound_wins_and_is_rounded_to_pad_to_multiple_of():
    collator = _Collator(padding="max_length", max_length=100, pad_to_multiple_of=64)
    assert size_run(_loader(collator), _MODEL, _config()).seq_len == 128
    trl_args = SimpleNamespace(max_length=64)
    sizing = size_run(_loader(_Collator()), _MODEL, _config(), seq_bound=seq_bound_of(trl_args))
    assert (sizing.seq_len, sizing.seq_cap, sizing.source) == (64, 64, "the run's sequence bound")
    assert seq_bound_of(SimpleNamespace()) is None


def test_explicit_fields_beat_the_data_and_no_loader_is_provisional():
    sizing = size_run(_loader(_Collator()), _MODEL, _config(batch_size=8, seq_len=256))
    assert (sizing.batch_size, sizing.seq_len) == (8, 256)
    provisional = size_run(None, _MODEL, _config())
    assert provisional.provisional and provisional.seq_len == 1  # never max positions


def test_growth_goes_to_the_next_power_of_two_within_the_cap():
    sizing = Sizing(batch_size=4, seq_len=34, source="the first batch", seq_cap=100)
    assert grown(sizing, 4, 40).seq_len == 64
    assert grown(sizing, 4, 90).seq_len == 100  # capped by the longest the run can produce
    assert grown(sizing, 4, 120).seq_len == 120  # beyond a guessed cap: at least the batch
    first = grown(Sizing(batch_size=1, seq_len=1, source="provisional", provisional=True),
                  3, 17)
    assert (first.batch_size, first.seq_len, first.provisional) == (3, 17, False)
