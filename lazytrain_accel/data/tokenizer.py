"""A word-level tokenizer built in code from the training texts (no downloads).

Words keep their leading space (SentencePiece's "▁" convention) and every digit is its own
token, so numbers of any size are spelled from ten tokens and decoding gives back the
exact text. It is a `PreTrainedTokenizerFast`, so it saves next to the checkpoint with
`save_pretrained` and reloads with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
_DIGITS = tuple("0123456789")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Metaspace(prepend_scheme="never"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(),
    ])


def build_word_tokenizer(texts: Iterable[str], *, min_count: int = 1) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is every piece seen in `texts` at least `min_count`
    times (plus specials and the ten digits), ordered by frequency then spelling, so the
    same texts always give the same ids."""
    if min_count < 1:
        raise ValueError(f"min_count={min_count} must be >= 1")
    splitter = _pre_tokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(piece for piece, _ in splitter.pre_tokenize_str(text))
    if not counts:
        raise ValueError("build_word_tokenizer needs at least one non-empty text")
    vocab = {token: i for i, token in enumerate((PAD, BOS, EOS, UNK, *_DIGITS))}
    for piece, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if count >= min_count and piece not in vocab:
            vocab[piece] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = splitter
    core.decoder = decoders.Metaspace(prepend_scheme="never")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS, unk_token=UNK)
