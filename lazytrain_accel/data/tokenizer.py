"""The demo's tokenizer: a Qwen2 byte-level BPE trained in code on the training texts.

The demo model is a Qwen2, and for `model_type: qwen2` transformers' `AutoTokenizer`
always builds a `Qwen2Tokenizer` (its ByteLevel pre-tokenizer, whatever class
`tokenizer_config.json` names). A tokenizer of any other form would be re-read
differently from a saved checkpoint and the reloaded model would score garbage, so the
demo's tokenizer *is* a `Qwen2Tokenizer`: Qwen2's pre-tokenizer (digits one by one,
words with their leading space), byte-level symbols, and BPE merges learned here from the
training texts until every word seen is one token. No downloads; the same texts always
give the same vocabulary and merges.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
#: Large enough never to stop the merges before every word seen is a single token.
_MAX_VOCAB = 1 << 16


def build_demo_tokenizer(texts: Iterable[str], *, min_count: int = 1) -> Qwen2Tokenizer:
    """A `Qwen2Tokenizer` whose merges are learned from `texts`: every piece seen at least
    `min_count` times becomes one token; anything else is spelled from its bytes."""
    if min_count < 1:
        raise ValueError(f"min_count={min_count} must be >= 1")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("build_demo_tokenizer needs at least one non-empty text")
    pipeline = Qwen2Tokenizer().backend_tokenizer  # Qwen2's normalizer and pre-tokenizer
    core = Tokenizer(models.BPE())
    core.normalizer = pipeline.normalizer
    core.pre_tokenizer = pipeline.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=_MAX_VOCAB, min_frequency=min_count,
                                  show_progress=False, special_tokens=[PAD, BOS, EOS, UNK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    learned = json.loads(core.to_str())["model"]
    return Qwen2Tokenizer(vocab=learned["vocab"],
                          merges=[tuple(pair) for pair in learned["merges"]],
                          pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)
