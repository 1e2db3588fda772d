"""The node store placed by owner: each update group's bytes on the NUMA node of the
local rank that owns the group, set before the leader's reservation allocates them."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lazytrain_accel import cores
from lazytrain_accel.distributed import first_touch, node_store, ownership, ranks
from lazytrain_accel.distributed.first_touch import Placement
from lazytrain_accel.engine.memory.residents import update_groups
from lazytrain_accel.engine.model.discovery import find_decoder_layers
from lazytrain_accel.run.node_layout import segment_nodes

PAGE = 4096
NUMA_MAPS = Path("/proc/self/numa_maps")


def _spans_placed(spans: list[tuple[int, int, int | None]]) -> list[tuple[int, int, int]]:
    return [(p.offset_bytes, p.length_bytes, p.node)
            for p in first_touch.page_placements(spans, page_bytes=PAGE)]


def test_a_shared_page_goes_to_the_first_span_and_neighbours_merge() -> None:
    spans = [(64, 5000, 0), (5056, 9000, 0), (9024, 20000, 1), (20032, 20100, 1)]
    assert _spans_placed(spans) == [(0, 3 * PAGE, 0), (3 * PAGE, 2 * PAGE, 1)]
    assert _spans_placed(list(reversed(spans))) == _spans_placed(spans)  # offset order


def test_a_span_of_no_node_keeps_its_pages_at_the_default() -> None:
    spans = [(0, 100, 0), (128, 3 * PAGE, None), (3 * PAGE, 4 * PAGE, 0),
             (4 * PAGE, 4 * PAGE + 64, 1)]
    assert _spans_placed(spans) == [(0, PAGE, 0), (3 * PAGE, PAGE, 0),  # not merged over
                                    (4 * PAGE, PAGE, 1)]
    assert _spans_placed([(0, 10, 1), (64, 100, 0)]) == [(0, PAGE, 1)]  # one page: first


def _two_sockets(tmp_path: Path) -> Path:
    for node, cpulist in (("node0", "0-7\n"), ("node1", "8-15\n"), ("node2", "\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist)  # node2: memory only (CXL)
    return tmp_path


def _model(*, tied: bool = False) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def test_each_groups_bytes_go_to_its_owners_socket(tmp_path: Path) -> None:
    """A 2-socket host of 8 cores each, 4 local ranks: ranks 0, 1 bound on socket 0 and
    2, 3 on socket 1, so the groups they own (the split update's rule) lie there."""
    topology = cores.numa_nodes(_two_sockets(tmp_path))
    assert topology == {0: set(range(8)), 1: set(range(8, 16))}
    bound = cores.split_cores(set(range(16)), list(topology.values()), 4)
    rank_nodes = [cores.node_of_cores(set(c), topology) for c in bound]
    assert rank_nodes == [0, 0, 1, 1]
    model = _model()
    nodes = segment_nodes(model, rank_nodes, device=torch.device("cpu"),
                          resident_update="host")
    groups = update_groups(model, *find_decoder_layers(model))
    owners = ownership.share_owners(groups, 4)
    assert owners == [0, 0, 1, 2, 3, 3]  # embeddings, 4 layers, final norm and head
    node_of = {id(p): rank_nodes[o] for g, o in zip(groups, owners, strict=True) for p in g}
    params = node_store.shared_params(model)
    assert nodes == [node_of[id(p)] for _, p in params]
    slots, _, nbytes, _ = node_store._layout(params, len(groups))
    placed = _spans_placed([(s.offset_bytes, s.offset_bytes + s.nbytes, n)
                            for s, n in zip(slots, nodes, strict=True)])
    assert [node for _, _, node in placed] == [0, 1]  # socket 0's run, then socket 1's
    assert placed[0][0] == 0 and placed[0][1] == placed[1][0]
    assert placed[1][0] + placed[1][1] == -(-nbytes // PAGE) * PAGE  # every page placed


def test_groups_every_rank_updates_are_not_placed() -> None:
    """Residents with their masters on each GPU (`resident_update="device"`) are owned by
    every rank: their bytes keep the default policy."""
    model = _model()
    nodes = segment_nodes(model, [0, 1], device=torch.device("cuda"),
                          resident_update="device")
    groups = update_groups(model, *find_decoder_layers(model))
    resident = {id(p) for p in groups[0] + groups[-1]}
    for (_, p), node in zip(node_store.shared_params(model), nodes, strict=True):
        assert (node is None) == (id(p) in resident)


def _gather_answering(monkeypatch: pytest.MonkeyPatch, others: list) -> list:
    """The all-gather of `ranks.local_numa_nodes`: `others`, then what this rank sent."""
    monkeypatch.setattr(ranks.dist, "get_world_size", lambda: len(others) + 1)
    sent: list = []

    def gather(out: list, mine: object) -> None:
        sent.append(mine)
        out[:] = [*others, mine]

    monkeypatch.setattr(ranks.dist, "all_gather_object", gather)
    return sent


def test_each_local_rank_reports_the_node_of_its_cores(monkeypatch, tmp_path: Path) -> None:
    topology = cores.numa_nodes(_two_sockets(tmp_path))
    monkeypatch.setattr(cores, "numa_nodes", lambda: topology)
    monkeypatch.setattr(ranks.os, "sched_getaffinity", lambda _: {9, 10, 11})
    sent = _gather_answering(monkeypatch, [("a", 0, 0), ("b", 1, 0)])
    assert ranks.local_numa_nodes(local_rank=1, node_id="a") == [0, 1]
    assert sent == [("a", 1, 1)]  # node b's ranks do not count


def test_a_host_of_one_node_places_nothing(monkeypatch) -> None:
    """One NUMA node: every rank still joins the all-gather (another host may have two),
    the answer is None, and the leader passes no nodes, so no mbind is made."""
    monkeypatch.setattr(cores, "numa_nodes", lambda: {0: {0, 1}})
    sent = _gather_answering(monkeypatch, [("a", 0, None)])
    assert ranks.local_numa_nodes(local_rank=1, node_id="a") is None
    assert sent == [("a", 1, None)]


def _policy_at(address: int) -> str:
    """The NUMA policy /proc/self/numa_maps shows for the mapping starting at `address`."""
    for line in NUMA_MAPS.read_text().splitlines():
        start, policy, *_ = line.split()
        if int(start, 16) == address:
            return policy
    raise AssertionError(f"no mapping at {address:#x} in {NUMA_MAPS}")


def _policy_of_page(fd: int, page: int) -> str:
    """The policy the segment `fd` keeps for page `page`, read through a fresh mapping of
    that page alone (shared memory keeps it per range of the file, not per mapping)."""
    with mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED,
                   offset=page * mmap.PAGESIZE) as view:
        anchor = ctypes.c_char.from_buffer(view)
        address = ctypes.addressof(anchor)
        del anchor
        return _policy_at(address)


#: How `first_touch` reports a kernel or a sandbox that refuses mbind (EPERM, ENOSYS).
REFUSALS = (os.strerror(errno.EPERM), os.strerror(errno.ENOSYS), "no mbind call number")


def _placed_or_skip(placed: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Skip where mbind is refused here; any other failure (EINVAL: a wrong call) fails."""
    if not placed and any(refusal in caplog.text for refusal in REFUSALS):
        pytest.skip(f"mbind is refused here: {caplog.text.strip()}")
    assert placed, caplog.text


@pytest.fixture
def numa_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    if not NUMA_MAPS.is_file():
        pytest.skip(f"{NUMA_MAPS} is missing (a kernel without NUMA)")
    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create")
    monkeypatch.setattr(first_touch, "_refusal_said", False)


def test_the_segment_keeps_each_ranges_policy(numa_maps, caplog) -> None:
    """Real system calls on this host (node 0): pages 1 and 2 of a 4-page segment placed,
    pages 0 and 3 left at the default."""
    page = mmap.PAGESIZE
    fd = os.memfd_create("lazytrain-first-touch-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 * page)
        with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
            placed = first_touch.place(fd, 4 * page, [
                Placement(offset_bytes=page, length_bytes=2 * page, node=0)])
        _placed_or_skip(placed, caplog)
        assert [_policy_of_page(fd, i) for i in range(4)] == [
            "default", "prefer:0", "prefer:0", "default"]
    finally:
        os.close(fd)


def test_the_leader_places_the_store_before_it_reserves_it(numa_maps, tmp_path, caplog,
                                                            monkeypatch) -> None:
    """`share_model` with nodes (forced: node 0 for every parameter, this host's one
    node): the policy is set before `posix_fallocate` allocates the pages, the store's
    mapping shows it, and the fill is the model's."""
    events: list[str] = []
    placed: list[bool] = []
    place, reserve = first_touch.place, os.posix_fallocate

    def place_recorded(*args: object) -> bool:
        events.append("place")
        placed.append(place(*args))
        return placed[-1]

    monkeypatch.setattr(first_touch, "place", place_recorded)
    monkeypatch.setattr(node_store.os, "posix_fallocate",
                        lambda *a: events.append("reserve") or reserve(*a))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    expected = [p.detach().clone() for p in model.parameters()]
    params = node_store.shared_params(model)
    with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
        store = node_store.share_model(
            model, name=node_store.segment_name(job_id=str(tmp_path), node_id="placed"),
            leader=True, local_ranks=1, num_groups=1, agree=lambda error: None,
            nodes=[0] * len(params))
    assert events == ["place", "reserve"]
    _placed_or_skip(placed == [True], caplog)
    assert _policy_at(store.bytes.data_ptr()) == "prefer:0"
    for p, value in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p, value)


def test_without_nodes_no_policy_is_set(numa_maps, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(first_touch, "_mbind", lambda *a: pytest.fail("mbind was called"))
    store = node_store.share_model(
        nn.Linear(4, 4), name=node_store.segment_name(job_id=str(tmp_path), node_id="n"),
        leader=True, local_ranks=1, num_groups=1, agree=lambda error: None)
    assert _policy_at(store.bytes.data_ptr()) == "default"


def test_a_refused_mbind_is_said_once_and_the_store_is_still_made(tmp_path, caplog,
                                                                  monkeypatch) -> None:
    """EPERM (a container's seccomp profile): one info line for the whole process, and
    both stores are made and filled: placement is an optimisation, never a failure."""
    monkeypatch.setattr(first_touch, "_refusal_said", False)
    monkeypatch.setattr(first_touch, "_mbind", lambda *a: errno.EPERM)
    models = [nn.Linear(64, 64) for _ in range(2)]
    expected = [m.weight.detach().clone() for m in models]
    with caplog.at_level(logging.INFO, logger="lazytrain_accel"):
        for i, model in enumerate(models):
            node_store.share_model(
                model, name=node_store.segment_name(job_id=str(tmp_path), node_id=str(i)),
                leader=True, local_ranks=1, num_groups=1, agree=lambda error: None,
                nodes=[1] * len(node_store.shared_params(model)))
    refusals = [r.getMessage() for r in caplog.records if "not placed" in r.getMessage()]
    assert len(refusals) == 1 and os.strerror(errno.EPERM) in refusals[0], refusals
    for model, weight in zip(models, expected, strict=True):
        assert torch.equal(model.weight, weight)
