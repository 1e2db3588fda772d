"""The node store's shared segment: anonymous or private, exclusive, never leaked, never
foreign; its bytes reserved before the fill, its descriptor handed over to this user only."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lazytrain_accel import preflight
from lazytrain_accel.distributed import (
    grad_reduce,
    node_store,
    ownership,
    peer_sync,
    segment_handoff,
    split_update,
)
from lazytrain_accel.distributed.generation_words import GenerationWords
from lazytrain_accel.distributed.node_store import SegmentSpaceError, UnsafeSegmentError
from lazytrain_accel.planning.node import EVERY_RANK, owner_of_groups

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model[1].weight.requires_grad_(False)  # frozen: kept in its own dtype
    return model


def _name(tmp_path: Path) -> str:
    return node_store.segment_name(job_id=str(tmp_path), node_id="test")


def _share(model: nn.Module, name: str, *, leader: bool, local_ranks: int = 1,
           agree: Callable[[Exception | None], None] = lambda error: None,
           directory: Path | None = None, num_groups: int = 1) -> node_store.NodeStore:
    return node_store.share_model(model, name=name, leader=leader, local_ranks=local_ranks,
                                  num_groups=num_groups, agree=agree, directory=directory)


class _Meeting:
    """Two threads' `agree`, as `ranks.raise_if_any_failed` is for processes: each meets
    the other, then both raise when either brought an error."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=30)
        self._errors: list[Exception] = []

    def __call__(self, error: Exception | None) -> None:
        if error is not None:
            self._errors.append(error)
        self._barrier.wait()
        if self._errors:
            raise RuntimeError(f"a rank could not open the node store: {self._errors[0]}")


def _share_pair(leader_model: nn.Module, follower_model: nn.Module, name: str, *,
                directory: Path | None = None
                ) -> tuple[node_store.NodeStore | Exception, node_store.NodeStore | Exception]:
    """A leader (this thread) and a follower (another thread) of one node, as two ranks,
    the segment in `directory` (None: anonymous): each one's store or what it raised."""
    meeting = _Meeting()
    results: dict[str, node_store.NodeStore | Exception] = {}

    def share(role: str, model: nn.Module) -> None:
        try:
            results[role] = _share(model, name, leader=role == "leader", local_ranks=2,
                                   agree=meeting, directory=directory)
        except Exception as err:  # handed to the test thread
            results[role] = err

    thread = threading.Thread(target=share, args=("follower", follower_model))
    thread.start()
    share("leader", leader_model)
    thread.join(timeout=60)
    return results["leader"], results["follower"]


def _mapped_segments(name: str) -> list[str]:
    """This process's mappings of the segment `name` (a memfd shows as /memfd:NAME)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines()
            if f"memfd:{name}" in line]


def test_names_differ_per_job_and_node() -> None:
    a = node_store.segment_name(job_id="job-a", node_id="n0")
    assert a != node_store.segment_name(job_id="job-b", node_id="n0")
    assert a != node_store.segment_name(job_id="job-a", node_id="n1")
    assert a == node_store.segment_name(job_id="job-a", node_id="n0")
    env_a = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env_b = {**env_a, "MASTER_PORT": "29501"}
    assert node_store.launch_identity(env_a) != node_store.launch_identity(env_b)
    nodes = [node_store.launch_identity({**env_a, "GROUP_RANK": r}) for r in ("0", "1")]
    assert nodes[0][1] != nodes[1][1]


def test_the_segment_is_anonymous_and_parameters_point_into_it(tmp_path: Path) -> None:
    """No name anywhere (nothing under /dev/shm), one mapping of an anonymous file."""
    model, name = _model(), _name(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    store = _share(model, name, leader=True, num_groups=3)
    assert not [n for n in os.listdir("/dev/shm") if name in n]
    assert len(_mapped_segments(name)) == 1
    start = store.bytes.data_ptr()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
        assert start <= p.data_ptr() < start + store.nbytes
    assert store.generations.view.tolist() == [0, 0, 0]


def test_a_follower_sees_the_leaders_writes(tmp_path: Path) -> None:
    leader, follower = _model(), _model()
    with torch.no_grad():
        follower[0].weight.zero_()  # a follower's own values are never used
    _, store = _share_pair(leader, follower, _name(tmp_path))
    assert isinstance(store, node_store.NodeStore), store
    assert torch.equal(follower[0].weight, leader[0].weight)
    with torch.no_grad():
        leader[2].bias.add_(1.0)
    assert torch.equal(follower[2].bias, leader[2].bias)  # one copy, two mappings


def test_a_layer_held_elsewhere_is_its_compute_copy_alone(tmp_path: Path) -> None:
    """The split layout below fp32 compute: a layer another node updates holds no master
    here (a placeholder, no bytes of the segment), only its bf16 compute copy, flat in its
    parameters' order, cast by the leader from the weights and seen by the follower; the
    segment is the smaller by the masters less the copy; its frozen weight stays."""
    leader, follower = _model(), _model()
    before = [p.detach().clone() for p in leader[1:].parameters()]
    elsewhere = [node_store.Elsewhere(layers={1: list(m[1:].parameters())},
                                      dtype=torch.bfloat16) for m in (leader, follower)]
    meeting = _Meeting()
    name, stores = _name(tmp_path), {}

    def share(role: str, model: nn.Module, where: node_store.Elsewhere) -> None:
        stores[role] = node_store.share_model(
            model, name=name, leader=role == "leader", local_ranks=2, num_groups=3,
            agree=meeting, elsewhere=where)

    thread = threading.Thread(target=share, args=("follower", follower, elsewhere[1]))
    thread.start()
    share("leader", leader, elsewhere[0])
    thread.join(timeout=60)
    whole = _share(_model(), _name(tmp_path / "whole"), leader=True, num_groups=3)
    for store, model in ((stores["leader"], leader), (stores["follower"], follower)):
        copy = store.copies[1]
        assert copy.dtype == torch.bfloat16
        assert copy.numel() == sum(p.numel() for p in model[1:].parameters())
        expected = torch.cat([t.reshape(-1) for t in before]).to(torch.bfloat16)
        assert torch.equal(copy, expected)
        assert node_store.is_placeholder(model[2].weight.data)
        assert model[2].weight.isnan().all() and model[2].weight.stride() == (0, 0)
        assert not node_store.is_placeholder(model[1].weight.data)  # frozen: in the store
        assert torch.equal(model[1].weight.detach(), before[0])
        assert not node_store.is_placeholder(model[0].weight.data)
    trainable = sum(p.numel() for p in leader[1:].parameters() if p.requires_grad)
    assert whole.nbytes - stores["leader"].nbytes >= 4 * trainable - 2 * copy.numel() - 64 * 4
    with pytest.raises(RuntimeError):
        leader[2].weight.data.add_(1.0)  # a placeholder cannot be written


def test_a_layer_homed_on_nvme_keeps_its_masters_on_the_rank_that_updates_it(
        tmp_path: Path) -> None:
    """Masters homed on NVMe by a node store's ranks: the store holds the layer's compute
    copy alone for both; the rank that updates it (here the follower) keeps its own
    masters out of the store, for its drive (`Elsewhere.kept`), the other a placeholder."""
    leader, follower = _model(), _model()
    before = follower[2].weight.data_ptr()
    name, stores, meeting = _name(tmp_path), {}, _Meeting()

    def share(role: str, model: nn.Module, kept: frozenset[int]) -> None:
        stores[role] = node_store.share_model(
            model, name=name, leader=role == "leader", local_ranks=2, num_groups=3,
            agree=meeting, elsewhere=node_store.Elsewhere(
                layers={1: list(model[1:].parameters())}, dtype=torch.bfloat16, kept=kept))

    thread = threading.Thread(target=share, args=("follower", follower, frozenset({1})))
    thread.start()
    share("leader", leader, frozenset())
    thread.join(timeout=60)
    assert (stores["leader"].kept, stores["follower"].kept) == (frozenset(), {1})
    assert node_store.is_placeholder(leader[2].weight.data)
    assert follower[2].weight.data_ptr() == before  # its own, not the segment's
    segment = stores["follower"].bytes
    assert not segment.data_ptr() <= before < segment.data_ptr() + segment.numel()
    assert torch.equal(stores["follower"].copies[1], stores["leader"].copies[1])


def test_a_state_dict_with_weights_on_other_nodes_is_refused_naming_the_gather() -> None:
    """`model.state_dict()` would hand out placeholders for the masters another node holds:
    it raises naming `accelerator.get_state_dict`; the parameters themselves
    (`keep_vars=True`, what checkpoints read) are still given."""
    from lazytrain_accel.distributed.node_exchange import refuse_partial_state_dicts

    model = _model()
    assert model.state_dict()  # nothing held elsewhere: as stock
    model[2].weight.data = node_store.placeholder(model[2].weight)
    refuse_partial_state_dicts(model)
    with pytest.raises(RuntimeError, match=r"2\.weight.*get_state_dict"):
        model.state_dict()
    assert model.state_dict(keep_vars=True)["2.weight"] is model[2].weight


def test_ranks_with_different_models_fail_with_a_sentence(tmp_path: Path) -> None:
    other = _model()
    other[2] = nn.Linear(16, 4, bias=False)
    leader, follower = _share_pair(_model(), other, _name(tmp_path))
    assert isinstance(follower, RuntimeError) and "different models" in str(follower), follower
    # the leader, whose own part went well, stops at the meeting with the follower's words
    assert isinstance(leader, RuntimeError) and "different models" in str(leader), leader


def test_a_leader_that_cannot_create_the_segment_stops_its_follower(tmp_path: Path) -> None:
    """The leader's segment cannot be created (its directory is gone): the follower, which
    would otherwise wait for a segment that never comes, raises with the leader's error at
    the first meeting."""
    leader, follower = _share_pair(_model(), _model(), _name(tmp_path),
                                   directory=tmp_path / "gone")
    assert isinstance(leader, RuntimeError) and "gone" in str(leader), leader
    assert isinstance(follower, RuntimeError) and "gone" in str(follower), follower


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_socket_of_another_user_is_refused(tmp_path: Path) -> None:
    """Another user (uid 65534) binds the handoff name first: a follower refuses to take
    a descriptor from it, and a leader fails to start instead of serving it."""
    name = _name(tmp_path)
    code = ("import os, socket, sys, time\nos.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.bind('\\0' + sys.argv[1]); s.listen(1)\n"
            "print('up', flush=True); time.sleep(30)\n")
    squatter = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        with pytest.raises(segment_handoff.ForeignPeerError, match="runs as uid 65534"):
            _share(_model(), name, leader=False, local_ranks=2)
        with pytest.raises(RuntimeError, match=r"handoff socket .* is taken"):
            _share(_model(), name, leader=True, local_ranks=2)
    finally:
        squatter.kill()
        squatter.wait()


@pytest.mark.parametrize("mode", [0o644, 0o660])
def test_a_planted_file_with_wider_permissions_is_refused(tmp_path: Path, mode: int) -> None:
    """`node_store_dir`: a file under the store's name that another user could read."""
    name = _name(tmp_path)
    path = tmp_path / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    os.fchmod(fd, mode)
    os.write(fd, b"planted" * 100)
    os.close(fd)
    model = _model()
    before = model[0].weight.data_ptr()
    with pytest.raises(UnsafeSegmentError, match="not 0600"):
        _share(model, name, leader=True, directory=tmp_path)
    assert path.read_bytes().startswith(b"planted")  # neither mapped nor removed
    assert model[0].weight.data_ptr() == before


def test_a_file_backed_segment_leaves_no_name(tmp_path: Path) -> None:
    model = _model()
    store = _share(model, _name(tmp_path), leader=True, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked once created
    assert torch.equal(model[0].weight, _model()[0].weight)
    assert store.bytes.data_ptr() <= model[0].weight.data_ptr()


def test_a_live_jobs_file_is_refused_a_dead_or_half_written_one_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A leader of a killed job left a file under the name: with its header (a dead
    pid), without one (magic 0: killed between sizing and the header), or empty. None
    blocks the next start; a running job's is refused and kept."""
    name = _name(tmp_path)
    path = tmp_path / name
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    _plant_header(path, node_store._MAGIC, os.getpid())
    with pytest.raises(UnsafeSegmentError, match=f"running job \\(pid {os.getpid()}\\)"):
        _share(_model(), name, leader=True, directory=tmp_path)
    assert path.exists()
    path.unlink()
    for magic, pid, size in ((node_store._MAGIC, int(dead.stdout), 4096), (0, 0, 4096),
                             (0, 0, 0)):
        _plant_header(path, magic, pid, size=size)
        _share(_model(), name, leader=True, directory=tmp_path)
        assert not path.exists()
    assert caplog.text.count("left by a killed job") == 3
    _plant_header(path, 0x1234, 0)  # not ours: refused, kept
    with pytest.raises(UnsafeSegmentError, match="not a LazyTrain segment"):
        _share(_model(), name, leader=True, directory=tmp_path)
    assert path.exists()


def _plant_header(path: Path, magic: int, pid: int, *, size: int = 4096) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    header = torch.tensor([magic, 1, pid, 4096, 0, 1, 0, 0], dtype=torch.int64)
    os.write(fd, header.numpy().tobytes().ljust(size, b"\0")[:size])
    os.close(fd)


def test_a_full_filesystem_is_an_error_before_the_fill(tmp_path: Path, monkeypatch) -> None:
    """`posix_fallocate` reserves the bytes first: ENOSPC is a sentence naming the bytes
    and the fixes, raised before any parameter moves, not a SIGBUS halfway."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(node_store.os, "posix_fallocate", full)
    model = _model()
    before = model[0].weight.data_ptr()
    with pytest.raises(SegmentSpaceError, match=r"needs \d+ bytes .* --shm-size"):
        _share(model, _name(tmp_path), leader=True, directory=tmp_path)
    assert model[0].weight.data_ptr() == before
    assert list(tmp_path.iterdir()) == []


def test_a_directory_too_small_falls_back_to_copies_or_refuses(tmp_path: Path) -> None:
    """`node_store_dir` cannot hold the store: with host memory for a copy per rank,
    the warning names the store's bytes, the free bytes and the fix; without, `prepare`
    refuses with the same numbers (`preflight.check_per_rank_copies`)."""
    model = _model()
    room = node_store.room_for(model, str(tmp_path))
    assert room.free_bytes == preflight.shm_free_bytes(str(tmp_path)) > 0
    assert room.need_bytes >= sum(p.numel() * 4 for p in model.parameters())
    small = preflight.SegmentRoom(directory="/dev/shm", need_bytes=3 * 2**30,
                                  free_bytes=64 * 2**20)
    estimate = preflight.HostMemoryEstimate(terms=(("masters", 5 * 2**30),),
                                            present_bytes=2**30)  # 4 GiB more per rank
    warning = preflight.check_per_rank_copies(small, estimate, copies=2,
                                              available_bytes=9 * 2**30)
    for words in ("needs 3.00 GiB in /dev/shm", "has 0.06 GiB free", "2 x 4.00 GiB",
                  "--shm-size=4g", "node_store_dir"):
        assert words in warning, warning
    with pytest.raises(preflight.PreflightError) as refused:
        preflight.check_per_rank_copies(small, estimate, copies=2, available_bytes=7 * 2**30)
    for words in ("needs 3.00 GiB in /dev/shm", "has 0.06 GiB free", "2 x 4.00 GiB",
                  "only 7.00 GiB available", "--shm-size=4g"):
        assert words in str(refused.value), refused.value


def test_owners_are_contiguous_byte_balanced_runs() -> None:
    assert owner_of_groups([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert owner_of_groups([100, 1, 1, 1, 1, 100], 2) == [0, 0, 0, 1, 1, 1]
    assert owner_of_groups([1, 50, 50, 1], 2, every_rank=(0, 3)) == [EVERY_RANK, 0, 1,
                                                                  EVERY_RANK]
    owners = owner_of_groups([5] * 8, 4)
    assert owners == sorted(owners) and set(owners) == {0, 1, 2, 3}
    assert owner_of_groups([0, 0], 3) == [0, 0]


def test_the_split_update_gives_each_rank_the_planners_share(monkeypatch) -> None:
    """`start_split_update` assigns by `owner_of_groups` of the groups' trainable bytes,
    the rule the simulator's lanes follow (tests/planning/test_node.py)."""
    groups = [[nn.Parameter(torch.zeros(n))] for n in (10, 30, 30, 30, 30, 5)]
    groups[0].append(nn.Parameter(torch.zeros(1000), requires_grad=False))  # weighs nothing

    class Engine:
        device = torch.device("cpu")
        node_copies = None

        class steps:
            update_groups, device_groups, peers, master_files = groups, [0, 5], None, None

        def register_grad_ready_hook(self, hook) -> None: ...

        def register_grad_taker(self, taker) -> None: ...

    for name, value in (("get_world_size", 2), ("get_rank", 0), ("get_backend", "gloo")):
        monkeypatch.setattr(split_update.dist, name, lambda value=value: value)
    monkeypatch.setattr(split_update.dist, "all_gather_object",
                        lambda out, pid, group=None: out.__setitem__(slice(None), [pid, pid]))
    engine = Engine()
    words = GenerationWords(bytearray(48), offset_bytes=0, count=6)
    split_update.start_split_update(engine, generations=words, should_reduce=lambda: True)
    owners = owner_of_groups([40, 120, 120, 120, 120, 20], 2)  # a CPU device: all shared
    assert owners == [0, 0, 0, 1, 1, 1]
    assert engine.steps.peers.foreign_groups == [g for g, o in enumerate(owners) if o != 0]


def test_a_waiter_names_a_dead_owner_within_a_second() -> None:
    """Layer 1's owner (local rank 1) was killed (SIGKILL, not reaped yet: a zombie, as
    under a launcher that polls): the wait raises naming it, not after 1800 s."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead.kill()
    time.sleep(0.2)
    try:
        assert not node_store.pid_alive(dead.pid) and node_store.pid_alive(os.getpid())
        peers = peer_sync.NodePeers(GenerationWords(bytearray(16), offset_bytes=0,
                                                    count=2),
                                    [0, 1], 0, pids=[os.getpid(), dead.pid])
        peers.begin_step()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"local rank 1 \(pid {dead.pid}\) died"):
            peers.wait(1)
        assert time.monotonic() - start < 3 * peer_sync.LIVENESS_CHECK_S
        peers.wait(0)  # its own group: never waits
    finally:
        dead.wait()


def test_a_waiter_returns_once_a_live_owner_publishes() -> None:
    generations = GenerationWords(bytearray(16), offset_bytes=0, count=2)
    peers = peer_sync.NodePeers(generations, [0, 1], 0, pids=[os.getpid()] * 2)
    peers.begin_step()
    assert not peers.is_ready(1)
    generations.publish(1, 1)  # the owner's publish, as seen through the segment
    # A regression would wait for a live owner up to the hang timeout (1800 s): the test
    # waits on a thread and fails within seconds instead.
    waiter = threading.Thread(target=peers.wait, args=(1,), daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "the waiter did not see the owner's publish within 30 s"


def test_a_launch_over_nodes_uses_the_store_per_node() -> None:
    one_node = {"LOCAL_WORLD_SIZE": "4"}
    assert node_store.unusable_because("auto", num_processes=4, env=one_node) is None
    assert node_store.unusable_because("auto", num_processes=8, env=one_node) is None
    assert "does not divide" in node_store.unusable_because("auto", num_processes=6,
                                                            env=one_node)
    assert "unset" in node_store.unusable_because("auto", num_processes=2, env={})
    assert node_store.unusable_because("off", num_processes=4, env=one_node) is not None
    no_memfd = "no memfd_create"
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(node_store.os, "memfd_create")
        assert no_memfd in node_store.unusable_because("auto", num_processes=4, env=one_node)
        assert node_store.unusable_because("auto", num_processes=4, env=one_node,
                                           store_dir="/dev/shm") is None


def test_node_groups_are_the_launchs_nodes_and_local_ranks(monkeypatch) -> None:
    """Rank 3 of 2 nodes x 2 (node "b" holds global ranks 1 and 3, in the launcher's
    order): its node's group, its local rank's group across the nodes, the node's ranks."""
    places = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    created: list[list[int]] = []
    monkeypatch.setattr(ownership.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(ownership.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(ownership.dist, "all_gather_object",
                        lambda out, _: out.__setitem__(slice(None), places))
    monkeypatch.setattr(ownership.dist, "new_group",
                        lambda ranks: created.append(list(ranks)) or tuple(ranks))
    layout = ownership.node_groups(local_rank=1, local_world_size=2, node_id="b")
    assert created == [[0, 2], [1, 3], [0, 1], [2, 3]]  # every rank creates every group
    assert (layout.node, layout.nodes, layout.local_rank) == (1, 2, 1)
    assert layout.node_ranks == (1, 3) and layout.intra == (1, 3)
    assert layout.cross == (2, 3)  # local rank 1 on node "a" (rank 2) and on "b" (rank 3)
    bad = [("a", 0), ("a", 0), ("b", 0), ("b", 1)]
    monkeypatch.setattr(ownership.dist, "all_gather_object",
                        lambda out, _: out.__setitem__(slice(None), bad))
    with pytest.raises(ValueError, match="taken"):
        ownership.node_groups(local_rank=1, local_world_size=2, node_id="b")


def test_a_rank_holds_only_its_shares_gradients_and_sends_the_rest_in_pieces(
        monkeypatch) -> None:
    """Issue 22, then 45: a rank held every layer's fp32 gradients twice (`.grad` and a
    flattened copy), then each other rank's layer whole in flight (12.9 GB a layer at
    405B). Now a layer this rank does not keep is taken where it landed (the bf16 staging
    here, never `.grad`) and sent in pieces of at most `REDUCE_PIECE_NUMEL` through one
    fp32 bucket, at most `MAX_REDUCES_IN_FLIGHT` groups queued; the owner reduces into
    its own `.grad` in place (no copy) and takes the mean: the same values as one
    process."""
    torch.manual_seed(0)
    piece_numel = 100  # a layer of 512 + 8 elements: 6 pieces in its weight, 1 in its bias
    monkeypatch.setattr(grad_reduce, "REDUCE_PIECE_NUMEL", piece_numel)
    layers = [[nn.Parameter(torch.zeros(64, 8)), nn.Parameter(torch.zeros(8))]
              for _ in range(6)]
    owners = [0, 0, 0, 1, 1, 1]  # this process is local rank 0: layers 3..5 are foreign
    sent: list[tuple[int, int, int]] = []  # (numel, dst, data_ptr)

    class Work:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None: ...

    def reduce(piece, dst, op, group, async_op):  # the peer's gradients: the same again
        sent.append((piece.numel(), dst, piece.data_ptr()))
        if dst == 0:
            piece.mul_(2)
        return Work()

    class Engine:
        def __init__(self) -> None:
            self.hooks: list = []
            self.taker = None
            self.refreshed: list = []

        def register_grad_ready_hook(self, hook) -> None:
            self.hooks.append(hook)

        def register_grad_taker(self, taker) -> None:
            self.taker = taker

        def refresh_grad_sq_norms(self, params) -> None:
            self.refreshed += params

        def grad_sq_norms(self) -> dict:
            return {}

        def release_grads(self, params) -> None:
            for p in params:
                p.grad = None

        def land(self, params, grads) -> object:  # `GradSink.fold` of staged gradients
            if (taken := self.taker(params, grads)) is not None:
                return taken
            for p, g in zip(params, grads, strict=True):
                p.grad = g.float()  # the fold's own fp32 storage
            for hook in self.hooks:
                hook(params)
            return None

    for name, value in (("get_world_size", 2), ("get_rank", 0), ("get_backend", "gloo")):
        monkeypatch.setattr(grad_reduce.dist, name, lambda value=value: value)
    monkeypatch.setattr(grad_reduce.dist, "reduce", reduce)
    engine = Engine()
    peers = peer_sync.NodePeers(torch.zeros(6, dtype=torch.int64), owners, 0,
                                pids=[os.getpid()] * 2)
    reducer = grad_reduce.ShareReducer(
        engine, layers, owners, peers=peers,
        layout=ownership.NodeGroups(local_rank=0, node=0, nodes=1, node_ranks=(0, 1)),
        should_reduce=lambda: True)
    grads, kept = {}, []
    for j in reversed(range(6)):  # the backward: last layer first
        landed = [torch.randn(p.shape, dtype=torch.bfloat16) for p in layers[j]]
        grads.update(zip(layers[j], [g.float() for g in landed], strict=True))
        taken = engine.land(layers[j], landed)
        assert (taken is None) == (owners[j] == 0)  # taken only where not kept
        assert all((p.grad is None) == (owners[j] == 1) for p in layers[j])
        kept += [(p.grad.data_ptr(), p.grad.numel()) for p in layers[j] if p.grad is not None]
        assert len(reducer._jobs) <= grad_reduce.MAX_REDUCES_IN_FLIGHT
        # no copy of a kept layer; at most the queued foreign layers and one piece
        assert reducer.held_grad_bytes() <= (
            2 * grad_reduce.MAX_REDUCES_IN_FLIGHT * 520 + 4 * piece_numel)
    reducer.finish()
    assert reducer.held_grad_bytes() == 0  # its bucket too, until the next step
    assert [n for n, _, _ in sent[:7]] == [100] * 5 + [12, 8]
    assert len(sent) == 6 * 7
    assert all(any(ptr <= at < ptr + 4 * n for ptr, n in kept)  # the owner's, in place
               for _, dst, at in sent if dst == 0)
    assert len({at for _, dst, at in sent if dst == 1}) == 1  # the others': one bucket
    for j, owner in enumerate(owners):
        for p in layers[j]:
            if owner == 0:  # (g + g) / 2, bit for bit
                assert torch.equal(p.grad, grads[p]) and p.grad.shape == p.shape
            else:
                assert p.grad is None
    assert {id(p) for p in engine.refreshed} == {id(p) for j in (0, 1, 2) for p in layers[j]}
