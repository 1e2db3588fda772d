"""Tiny local assets a user's script loads as it would load a hub model: a model directory
(config, weights, a word-level fast tokenizer) and text files. Nothing is downloaded."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "log", "red", "big", "small",
         "fast", "slow", "and", "then", "it", "was", "happy", "sad", "home", "park", "tree",
         "sun", "moon", "day", "night", "saw"]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def make_model_dir(path: Path, *, num_layers: int = 3, seed: int = 0,
                   hidden_size: int = 32) -> Path:
    """A 3-layer Llama (hidden 32, MLP twice that) with its tokenizer, saved with
    `save_pretrained`."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                        unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        model_max_length=256)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sentences(num: int, *, seed: int = 0, min_words: int = 3, max_words: int = 14) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(num)]


def make_text_files(root: Path) -> tuple[Path, Path]:
    """train.txt and validation.txt, one sentence per line (the `text` loader's format)."""
    train, validation = root / "train.txt", root / "validation.txt"
    train.write_text("\n".join(sentences(120, seed=1)) + "\n")
    validation.write_text("\n".join(sentences(30, seed=2)) + "\n")
    return train, validation
