"""The in-code tokenizer and the collation of prompt-masked, fixed-shape batches."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config

from lazytrain_accel.data.arithmetic import generate_problems
from lazytrain_accel.data.collate import (
    IGNORE_INDEX,
    CausalLMCollator,
    encode_record,
    encode_records,
    prompt_of,
)
from lazytrain_accel.data.tokenizer import build_demo_tokenizer

RECORDS = generate_problems(300, seed=11)
TEXTS = [r["query"] + "\n" + r["response"] for r in RECORDS]


def test_decoding_gives_back_the_exact_text() -> None:
    tokenizer = build_demo_tokenizer(TEXTS)
    for text in TEXTS:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_digits_are_single_tokens_and_unknown_words_are_spelled_from_bytes() -> None:
    tokenizer = build_demo_tokenizer(TEXTS)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("buys 1234")["input_ids"])
    assert pieces[-4:] == ["1", "2", "3", "4"]
    assert tokenizer.convert_ids_to_tokens(tokenizer(" apples")["input_ids"]) == ["\u0120apples"]
    ids = tokenizer("Tom owns zebras")["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "Tom owns zebras"


def test_same_texts_same_vocabulary_and_it_survives_save_pretrained(tmp_path: Path) -> None:
    first, second = build_demo_tokenizer(TEXTS), build_demo_tokenizer(list(TEXTS))
    assert first.get_vocab() == second.get_vocab()
    first.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(TEXTS[0])["input_ids"] == first(TEXTS[0])["input_ids"]
    assert reloaded.pad_token_id == first.pad_token_id == 0


def test_reloads_identically_beside_a_qwen2_config(tmp_path: Path) -> None:
    """AutoTokenizer picks the tokenizer class from `model_type: qwen2` (Qwen2Tokenizer,
    ByteLevel), not from tokenizer_config.json: a checkpoint must survive exactly that."""
    tokenizer = build_demo_tokenizer(TEXTS)
    tokenizer.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(reloaded) == len(tokenizer)
    for text in TEXTS[:50]:
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert [reloaded.pad_token_id, reloaded.eos_token_id] == [tokenizer.pad_token_id,
                                                              tokenizer.eos_token_id]


def test_labels_cover_exactly_the_response_and_end_token() -> None:
    tokenizer = build_demo_tokenizer(TEXTS)
    record = RECORDS[0]
    example = encode_record(tokenizer, record, seq_len=64)
    prompt_len = len(tokenizer(prompt_of(record))["input_ids"])
    assert example.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    learned = example.labels[prompt_len:]
    assert learned[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(learned[:-1]) == record["response"]
    assert example.input_ids[prompt_len:] == learned


def test_records_encoded_in_one_batch_are_each_records_own_tokens() -> None:
    """The batched encoding the demo's loader uses gives every record the ids of its own
    prompt and response, tokenized one string at a time, cut alike."""
    tokenizer = build_demo_tokenizer(TEXTS)
    for seq_len in (16, 64):
        examples = encode_records(tokenizer, RECORDS, seq_len=seq_len)
        assert len(examples) == len(RECORDS)
        for record, example in zip(RECORDS, examples, strict=True):
            prompt = tokenizer(prompt_of(record), add_special_tokens=False)["input_ids"]
            response = tokenizer(record["response"], add_special_tokens=False)["input_ids"]
            whole = prompt + response + [tokenizer.eos_token_id]
            assert example.input_ids == whole[:seq_len]
            assert example.labels == ([IGNORE_INDEX] * len(prompt) + whole[len(prompt):])[:seq_len]
    assert encode_records(tokenizer, [], seq_len=8) == []


def test_collator_pads_every_batch_to_seq_len_and_masks_padding() -> None:
    tokenizer = build_demo_tokenizer(TEXTS)
    examples = [encode_record(tokenizer, r, seq_len=40) for r in RECORDS[:5]]
    assert max(len(e.input_ids) for e in examples) == 40  # the long ones are cut
    batch = CausalLMCollator(pad_token_id=tokenizer.pad_token_id, seq_len=48)(examples)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (5, 48), "attention_mask": (5, 48), "labels": (5, 48)}
    padding = batch["attention_mask"] == 0
    assert torch.all(batch["labels"][padding] == IGNORE_INDEX)
    assert torch.all(batch["input_ids"][padding] == tokenizer.pad_token_id)
    assert batch["attention_mask"].sum(1).tolist() == [len(e.input_ids) for e in examples]
