"""NVMe boundaries live in files (not RAM) while offloaded; nothing outlives a step; stats."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_helpers import batches, build_model, make_plan

from lazytrain_accel.engine import attach

CPU = torch.device("cpu")


def test_nvme_boundaries_are_on_disk_not_in_ram_between_forward_and_backward(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("all_nvme", 4), device=CPU, nvme_dir=str(tmp_path))
    host = engine.streams.host_tier  # pinned under the emulated async device
    staging_bytes = engine.stats().current_bytes[host]  # its weight and gradient staging
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    engine.synchronize()
    boundary_bytes = 2 * 16 * 32 * 4
    tiers = engine.boundary_tiers()
    # the test plan reloads boundary 3 (read by the first backward) already in F4
    assert tiers == {0: {"device"}, 1: {"nvme"}, 2: {"nvme"}, 3: {"device", "nvme"}}, tiers
    files = list(tmp_path.rglob("*.bin"))
    assert len(files) == 3 and all(f.stat().st_size == boundary_bytes for f in files)
    assert [d.name.startswith("lazytrain-") for d in tmp_path.iterdir()] == [True]
    stats = engine.stats()
    assert stats.current_bytes["nvme"] == 3 * boundary_bytes
    assert stats.current_bytes[host] == staging_bytes  # host copies freed once written
    assert stats.peak_bytes[host] >= staging_bytes + boundary_bytes  # ...after staging there
    loss.backward()
    engine.synchronize()
    assert not list(tmp_path.rglob("*.bin"))
    stats = engine.stats()
    assert stats.transfer_bytes["nvme_write"] == 3 * boundary_bytes
    # boundary 3 came back from its host copy in F4, before its write was even reaped
    assert stats.transfer_bytes["nvme_read"] == 2 * boundary_bytes
    assert stats.current_bytes["nvme"] == 0
    engine.detach()
    assert not list(tmp_path.iterdir())  # the engine's own directory went with it


def test_no_file_left_after_exception_in_forward(tmp_path):
    model = build_model("llama", 4)
    engine = attach(model, make_plan("all_nvme", 4), device=CPU, nvme_dir=str(tmp_path))

    def fail(*_):
        raise RuntimeError("boom in layer 3")

    handle = model.model.layers[2].mlp.register_forward_hook(fail)
    ids = batches(1)[0]
    with pytest.raises(RuntimeError, match="boom in layer 3"):
        model(input_ids=ids, labels=ids)
    handle.remove()
    engine.synchronize()
    assert not list(tmp_path.rglob("*.bin"))


def test_no_file_left_after_exception_in_backward_or_abandoned_graph(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("all_nvme", 4), device=CPU, nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    engine.synchronize()
    assert list(tmp_path.rglob("*.bin"))
    hidden = model.model.layers[1].self_attn.q_proj.weight

    def fail(_):
        raise RuntimeError("boom in backward")

    handle = hidden.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    handle.remove()
    engine.synchronize()
    assert not list(tmp_path.rglob("*.bin"))
    # a forward whose loss is dropped without backward leaves nothing either
    loss = model(input_ids=ids, labels=ids).loss
    engine.synchronize()
    del loss
    gc.collect()
    engine.synchronize()
    assert not list(tmp_path.rglob("*.bin"))


def test_stats_follow_the_plan(tmp_path):
    model = build_model("qwen2", 10)
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path))
    staging_bytes = engine.stats().current_bytes[engine.streams.host_tier]
    ids = batches(1)[0]
    engine.reset_stats()
    model(input_ids=ids, labels=ids).loss.backward()
    stats = engine.stats()
    boundary_bytes = 2 * 16 * 32 * 4
    # mixed plan: boundaries 1 and 6 on CPU, 3 on NVMe, 2 4 5 7 8 9 recomputed
    assert stats.transfer_bytes["d2h"] == 3 * boundary_bytes
    assert stats.transfer_bytes["h2d"] == 3 * boundary_bytes
    assert stats.transfer_bytes["nvme_write"] == boundary_bytes
    assert stats.layer_forwards == 10 and stats.layer_backwards == 10
    # blocks (1,3) (3,6) (6,10) regenerate 1 + 2 + 3 boundaries
    assert stats.layer_recomputes == 6
    assert stats.compute_s > 0 and stats.recompute_s > 0
    host = engine.streams.host_tier
    assert stats.peak_bytes["device"] > 0 and stats.current_bytes[host] == staging_bytes
    layer_bytes = sum(p.numel() * 4 for p in engine.layer_params(1))
    # weights stream once per forward, backward and recompute, less what the pool still
    # holds: layer 10's forward copy for its backward, and the last re-run layers of each
    # block for their backward (two of blocks (3,6) and (6,10), one of block (1,3))
    loads, rest = divmod(stats.transfer_bytes["weights_h2d"], layer_bytes)
    assert rest == 0 and loads == 10 + 10 + 6 - 1 - 2 - 2 - 1


def test_flush_at_interpreter_exit_is_a_no_op(tmp_path):
    """A multi-process run's exit teardown (`ranks.register_exit_teardown`, an `atexit`
    hook) waits for the engine after concurrent.futures' exit hook shut the spill's
    executor down: the flush finds its queue drained instead of failing ("cannot schedule
    new futures after shutdown")."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import atexit
        from lazytrain_accel.engine.memory.nvme import NvmeSpill
        from lazytrain_accel.engine.stats import Accounting
        import torch

        spill = NvmeSpill({str(tmp_path)!r}, Accounting())
        spill.write("a.bin", torch.ones(4))
        def at_exit():
            spill.flush()
            print("flushed", flush=True)
        atexit.register(at_exit)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flushed" in proc.stdout, proc.stderr[-3000:]
