"""The node store's generations: written only by release stores, read by acquire loads."""

from __future__ import annotations

import logging
import mmap
import multiprocessing
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lazytrain_accel.config import ANONYMOUS_SEGMENT
from lazytrain_accel.distributed import generation_words, node_store
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.run.node_layout import node_layout_for

pytestmark = pytest.mark.skipif(generation_words.unavailable_because() is not None,
                                reason=f"{generation_words.unavailable_because()}")

_WORDS_PER_GROUP = 64  # 512 bytes: a group's payload spans several cache lines
_PAYLOAD_OFFSET_BYTES = 64  # the generation words (<= 8 of them) fill the first line
_GENERATIONS = 20_000


def _publish_and_check(rank: int, processes: int, buffer: mmap.mmap) -> None:
    """Owner of group `rank`: write generation g's pattern (word i holds g * K + i), then
    publish g. Reader of a peer's group after each publish: every word must hold the
    pattern of the generation it saw or a later one, never an earlier one. Exits 1 with
    the first stale read."""
    k = _WORDS_PER_GROUP
    words = GenerationWords(buffer, offset_bytes=0, count=processes)
    payload = memoryview(buffer)[_PAYLOAD_OFFSET_BYTES:].cast("q")
    for generation in range(1, _GENERATIONS + 1):
        payload[rank * k:(rank + 1) * k] = array("q", range(generation * k,
                                                             generation * k + k))
        words.publish(rank, generation)
        peer = (rank + 1 + generation % (processes - 1)) % processes
        seen = words.read(peer)
        if seen == 0:  # not published yet: no pattern to check
            continue
        values = payload[peer * k:(peer + 1) * k].tolist()
        stale = [(i, v) for i, v in enumerate(values) if v % k != i or v // k < seen]
        if stale:
            i, v = stale[0]
            raise SystemExit(f"rank {rank} saw group {peer} at generation {seen} but its "
                             f"word {i} holds generation {v // k}'s value {v}")
    words_seen = [words.read(g) for g in range(processes)]
    if words_seen[rank] != _GENERATIONS:
        raise SystemExit(f"rank {rank} reads back generation {words_seen[rank]}")


@pytest.mark.parametrize("processes", [2, 4])
def test_every_read_after_a_generation_sees_its_writes(processes: int) -> None:
    """Owners publish 20,000 generations each over a shared mapping while reading the
    others' groups (the node store's pattern, between processes)."""
    nbytes = _PAYLOAD_OFFSET_BYTES + 8 * _WORDS_PER_GROUP * processes
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)  # inherited by the forks
    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=_publish_and_check, args=(r, processes, buffer))
               for r in range(processes)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0] * processes
    assert GenerationWords(buffer, offset_bytes=0, count=processes).view.tolist() == [
        _GENERATIONS] * processes


def test_python_sees_the_generations_read_only(tmp_path: Path) -> None:
    """No Python store to a generation: the view is read-only and the store's header
    tensor ends before the words (only `publish` writes them)."""
    name = node_store.segment_name(job_id=str(tmp_path), node_id="words")
    store = node_store.share_model(nn.Linear(2, 2), name=name, leader=True, local_ranks=1,
                                   num_groups=3, agree=lambda error: None)
    with pytest.raises(TypeError, match="read-only"):
        store.generations.view[1] = 5
    assert store.header.numel() * store.header.element_size() == 8 * 8
    store.generations.publish(1, 5)
    assert store.generations.view.tolist() == [0, 5, 0]
    assert store.generations.read(1) == 5
    with pytest.raises(IndexError, match=r"group 3 is out of 0\.\.2"):
        store.generations.read(3)
    assert torch.equal(store.header[:1], torch.tensor([0x4C5A_5452_4E53_5431]))


def test_without_the_helper_the_node_store_is_refused_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(generation_words, "unavailable_because",
                        lambda: "no C++ compiler (test)")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plugin = SimpleNamespace(node_store="auto", node_store_dir=ANONYMOUS_SEGMENT)
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        layout = node_layout_for(plugin, nn.Linear(2, 2), num_processes=2,
                                 is_main_process=True)
    assert layout.node_ranks == 1
    assert "node store is refused: no C++ compiler (test)" in caplog.text
