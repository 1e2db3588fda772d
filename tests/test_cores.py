"""Each local rank's cores: disjoint, covering the usable ones, inside one socket."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from lazytrain_accel import cores


def _check_partition(sets: list[list[int]], usable: set[int]) -> None:
    flat = [c for s in sets for c in s]
    assert len(flat) == len(set(flat)), sets  # disjoint
    assert set(flat) == usable, sets  # covering


def test_one_socket_two_cores_two_ranks() -> None:
    assert cores.split_cores({0, 1}, [{0, 1}], 2) == [[0], [1]]


def test_two_sockets_of_eight_four_ranks_stay_inside_their_socket() -> None:
    sockets = [set(range(8)), set(range(8, 16))]
    sets = cores.split_cores(set(range(16)), sockets, 4)
    _check_partition(sets, set(range(16)))
    assert [len(s) for s in sets] == [4, 4, 4, 4]
    assert all(set(s) <= sockets[0] or set(s) <= sockets[1] for s in sets)


def test_uneven_ranks_and_sockets_still_cover_every_core() -> None:
    sockets = [{0}, set(range(1, 16))]  # a 1-core socket is nobody's leftover
    sets = cores.split_cores(set(range(16)), sockets, 3)
    _check_partition(sets, set(range(16)))
    assert all(set(s) <= sockets[0] or set(s) <= sockets[1] for s in sets)
    three = cores.split_cores(set(range(16)), [set(range(8)), set(range(8, 16))], 3)
    _check_partition(three, set(range(16)))
    assert all(len(set(s) & set(range(8))) in (0, len(s)) for s in three)


def test_fewer_ranks_than_sockets_take_whole_sockets() -> None:
    sockets = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    assert cores.split_cores(set(range(8)), sockets, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_only_the_usable_cores_are_dealt() -> None:
    sets = cores.split_cores({2, 3, 5, 9}, [set(range(8)), set(range(8, 16))], 2)
    _check_partition(sets, {2, 3, 5, 9})


def test_more_ranks_than_cores_share_round_robin() -> None:
    assert cores.split_cores({0, 1}, [{0, 1}], 4) == [[0], [1], [0], [1]]
    with pytest.raises(ValueError, match="ranks=0"):
        cores.split_cores({0, 1}, [{0, 1}], 0)


def test_ranks_the_launcher_pinned_are_left_alone() -> None:
    assert cores.cores_of_rank(1, [{0, 1}, {2, 3}], [set(range(4))]) is None
    assert cores.cores_of_rank(1, [set(range(4))] * 2, [set(range(4))]) == [2, 3]


def test_the_topology_is_read_from_sysfs(tmp_path: Path) -> None:
    for node, cpulist in (("node1", "8-11,20\n"), ("node0", "0-3\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist)
    assert cores.sockets(tmp_path) == [{0, 1, 2, 3}, {8, 9, 10, 11, 20}]
    assert cores.sockets(tmp_path / "missing")  # no sysfs: one socket of every CPU


def test_nodes_keep_their_numbers_and_a_rank_takes_its_cores_node(tmp_path: Path) -> None:
    for node, cpulist in (("node3", "4-7\n"), ("node0", "0-3\n"), ("node1", "\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist)  # node1: memory only
    nodes = cores.numa_nodes(tmp_path)
    assert nodes == {0: {0, 1, 2, 3}, 3: {4, 5, 6, 7}}  # mbind's numbers, not positions
    assert cores.numa_nodes(tmp_path / "missing") == {}
    assert cores.node_of_cores({5, 6}, nodes) == 3
    assert cores.node_of_cores({2, 3, 4}, nodes) == 0  # most of its cores
    assert cores.node_of_cores({3, 4}, nodes) == 0  # a tie: the lowest node
    assert cores.node_of_cores({9}, nodes) is None


def test_binding_reaches_threads_started_before_it() -> None:
    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    ready, go = threading.Event(), threading.Event()

    def worker() -> None:
        ready.set()
        go.wait()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait()
    mine = [min(before)]
    try:
        cores.bind_threads(mine)
        go.set()
        thread.join()
        assert seen == [set(mine)] and os.sched_getaffinity(0) == set(mine)
    finally:
        cores.bind_threads(sorted(before))


def _gathered(monkeypatch: pytest.MonkeyPatch, places: list) -> list[list[int]]:
    """`ranks.bind_local_cores` with the all-gather answering `places`; the cores it
    bound (none when it left them)."""
    from lazytrain_accel.distributed import ranks
    bound: list[list[int]] = []
    monkeypatch.setattr(ranks.dist, "get_world_size", lambda: len(places))
    monkeypatch.setattr(ranks.dist, "all_gather_object",
                        lambda out, _: out.__setitem__(slice(None), places))
    monkeypatch.setattr(ranks.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    monkeypatch.setattr(cores, "sockets", lambda: [{0, 1, 2, 3}])
    monkeypatch.setattr(cores, "bind_threads", bound.append)
    ranks.bind_local_cores(local_rank=1, node_id="a")
    return bound


def test_a_rank_takes_its_share_among_its_nodes_ranks(monkeypatch) -> None:
    everything = [0, 1, 2, 3]
    two_nodes = [("a", 0, everything), ("a", 1, everything), ("b", 0, [0]), ("b", 1, [1])]
    assert _gathered(monkeypatch, two_nodes) == [[2, 3]]  # node b's masks do not count
    pinned = [("a", 0, [0, 1]), ("a", 1, [2, 3])]
    assert _gathered(monkeypatch, pinned) == []  # the launcher's own pinning is kept
    misnumbered = [("a", 1, everything), ("a", 2, everything)]
    assert _gathered(monkeypatch, misnumbered) == []
