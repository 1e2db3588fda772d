"""Preflight: host memory and the NVMe directory fail in `prepare`, before any allocation."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from fault_helpers import loader, plan_json, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin, preflight
from lazytrain_accel.planning.plan import Home, Plan
from lazytrain_accel.preflight import PreflightError

GIB = 2**30


def _prepare(tmp_path: Path, model: torch.nn.Module, **plugin_kwargs: object) -> Accelerator:
    plugin = LazyTrainPlugin(hardware="h800", cache_dir=str(tmp_path / "cache"),
                             **plugin_kwargs)
    acc = Accelerator(cpu=True, plugin=plugin)
    acc.prepare(model, torch.optim.AdamW(model.parameters()), loader())
    return acc


def _assert_untouched(model: torch.nn.Module) -> None:
    """Nothing was attached: no layer forward is patched, no parameter moved or cast."""
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def test_host_estimate_is_the_planners_terms_at_the_plans_homes(tmp_path) -> None:
    from lazytrain_accel.planning.host import CPU_HOME_TERM, NVME_STAGING_TERM, OPTIMIZER_TERM
    from lazytrain_accel.planning.problem import build_problem
    from lazytrain_accel.profiling.hardware_spec import load_hardware
    from lazytrain_accel.run import setup

    model = tiny_model()
    plan = Plan.load(plan_json(tmp_path, model, Home.CPU))
    profile = setup.profile_for_run(model, batch_size=plan.batch_size, seq_len=plan.seq_len,
                                    compute_dtype=None)
    est = preflight.estimate_host_bytes(model_profile=profile, plan=plan, optimizer="keep",
                                        present_bytes=4000)
    terms = dict(est.terms)
    # One model: the MIP's host row at these homes, less the NVMe bounce buffers it
    # always charges (this plan homes nothing on NVMe).
    p = build_problem(profile, load_hardware("h800"), optimizer="keep",
                      max_recompute_block=max(e - s for s, e in plan.blocks))
    assert terms[CPU_HOME_TERM] == 3 * plan.boundary_bytes and terms[NVME_STAGING_TERM] == 0
    assert est.total_bytes == p.tier_need_bytes(gpu=0, cache=0, cpu=3, nvme=0)["cpu"] - (
        p.host_staging_boundaries * plan.boundary_bytes)
    n = profile.trainable_param_count
    assert terms[f"{OPTIMIZER_TERM} (keep)"] == 8 * n  # AdamW: two fp32 moments
    assert est.new_bytes == est.total_bytes - 4000
    hybrid = preflight.estimate_host_bytes(model_profile=profile, plan=plan,
                                           optimizer="hybrid8bit", present_bytes=0)
    assert dict(hybrid.terms)[f"{OPTIMIZER_TERM} (hybrid8bit)"] == int(n * (2 + 8 / 256))
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        preflight.estimate_host_bytes(model_profile=profile, plan=plan, optimizer="sgd",
                                      present_bytes=0)


def test_available_host_bytes_is_within_physical_memory() -> None:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < preflight.available_host_bytes() <= total


def test_too_little_host_memory_fails_in_prepare_before_attaching(tmp_path, monkeypatch) -> None:
    model = tiny_model()
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 64 * 1024)
    with pytest.raises(PreflightError) as info:
        _prepare(tmp_path, model, plan=plan_json(tmp_path, model, Home.CPU),
                 nvme_dir=str(tmp_path / "nvme"))
    text = str(info.value)
    for words in ("host memory", "the optimizer state (hybrid8bit)",
                  "boundaries homed in host DRAM", "the trainable parameters' fp32 masters",
                  "--lora-rank", "0.00 GiB is available", "cpu_memory_limit_gb"):
        assert words in text, text
    _assert_untouched(model)


def test_enough_host_memory_passes(tmp_path) -> None:
    model = tiny_model()
    acc = _prepare(tmp_path, model, plan=plan_json(tmp_path, model, Home.CPU),
                   nvme_dir=str(tmp_path / "nvme"))
    assert acc.lazytrain.engine is not None
    acc.end_training()


def test_missing_nvme_dir_with_missing_parent_fails(tmp_path) -> None:
    model = tiny_model()
    missing = tmp_path / "not_mounted" / "lazytrain"
    with pytest.raises(PreflightError, match="does not exist, nor does its parent"):
        _prepare(tmp_path, model, plan=plan_json(tmp_path, model, Home.NVME),
                 nvme_dir=str(missing))
    assert not missing.parent.exists()
    _assert_untouched(model)


def test_missing_nvme_dir_under_an_existing_parent_is_created(tmp_path) -> None:
    preflight.check_nvme_dir(str(tmp_path / "spill"), need_bytes=1)
    assert (tmp_path / "spill").is_dir() and not list((tmp_path / "spill").iterdir())


def test_nvme_dir_that_is_a_file_fails(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(PreflightError, match="is a file, not a directory"):
        preflight.check_nvme_dir(str(tmp_path / "file"), need_bytes=1)


def test_plans_without_nvme_homes_never_touch_the_dir(tmp_path) -> None:
    preflight.check_nvme_dir(str(tmp_path / "a" / "b"), need_bytes=0)
    assert not (tmp_path / "a").exists()


def test_unwritable_nvme_dir_fails() -> None:
    # Not under tmp_path: pytest's root is private, and the probe may run as another user.
    home = Path(tempfile.mkdtemp(prefix="lazytrain-ro-"))
    home.chmod(0o711)
    target = home / "ro"
    target.mkdir()
    target.chmod(0o555)
    try:
        if os.geteuid() != 0:
            with pytest.raises(PreflightError, match="is not writable"):
                preflight.check_nvme_dir(str(target), need_bytes=1)
        else:  # root ignores permission bits: probe from a child that drops to nobody
            assert _check_as_nobody(target) == "PreflightError: is not writable"
        assert not list(target.iterdir())
    finally:
        target.chmod(0o700)
        shutil.rmtree(home)


def _check_as_nobody(target: Path) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no imports, the module is already loaded
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            preflight.check_nvme_dir(str(target), need_bytes=1)
            out = "passed"
        except PreflightError as err:
            out = "PreflightError: is not writable" if "is not writable" in str(err) \
                else f"PreflightError: {err}"
        except BaseException as err:  # report anything to the parent
            out = f"{type(err).__name__}: {err}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return out


def test_nvme_dir_with_too_little_free_space_fails_in_prepare(tmp_path, monkeypatch) -> None:
    model = tiny_model()
    free = shutil.disk_usage(tmp_path).free
    from lazytrain_accel.planning import Plan

    path = plan_json(tmp_path, model, Home.NVME)
    plan = Plan.load(path)
    need = preflight.nvme_need_bytes(plan)
    assert need == 3 * plan.boundary_bytes
    # The real free space is checked; a plan needing more than it fails with both figures.
    with pytest.raises(PreflightError, match="GiB free but the plan keeps"):
        preflight.check_nvme_dir(str(tmp_path), need_bytes=free + GIB)
    monkeypatch.setattr(preflight, "nvme_need_bytes", lambda _plan, *_model: free + GIB)
    with pytest.raises(PreflightError, match="nvme_limit_gb"):
        _prepare(tmp_path, model, plan=path, nvme_dir=str(tmp_path / "nvme"))
    _assert_untouched(model)


def test_a_node_plan_checks_the_nodes_bytes(tmp_path) -> None:
    """A plan for 2 local ranks sharing one copy (the node store): the shared state once,
    each rank's staging and DRAM boundaries twice, both ranks' models present; a host
    that holds one rank's run but not the node's refuses, naming the per-rank terms."""
    import dataclasses

    from lazytrain_accel.planning import Plan
    from lazytrain_accel.planning.host import CPU_HOME_TERM, MASTER_TERM, per_rank
    from lazytrain_accel.run import setup

    model = tiny_model()
    one = Plan.load(plan_json(tmp_path, model, Home.CPU))
    node = dataclasses.replace(one, gpus_per_node=2)
    profile = setup.profile_for_run(model, batch_size=one.batch_size, seq_len=one.seq_len,
                                    compute_dtype=None)
    kwargs = {"model_profile": profile, "optimizer": "keep", "present_bytes": 0}
    one_terms = dict(preflight.estimate_host_bytes(plan=one, **kwargs).terms)
    node_terms = dict(preflight.estimate_host_bytes(plan=node, **kwargs).terms)
    assert node_terms[MASTER_TERM] == one_terms[MASTER_TERM]  # shared: once
    assert node_terms[per_rank(CPU_HOME_TERM, 2)] == 2 * one_terms[CPU_HOME_TERM]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    check = {"model": model, "model_profile": profile, "optimizer": "keep",
             "nvme_dir": str(tmp_path / "nvme"), "checkpoint_dtype": "auto"}
    one_new = preflight.check_run(plan=one, available_bytes=1 << 40, **check).new_bytes
    node_estimate = preflight.check_run(plan=node, available_bytes=1 << 40, **check)
    assert node_estimate.present_bytes == 2 * model_bytes
    assert node_estimate.new_bytes > one_new
    preflight.check_run(plan=one, available_bytes=one_new, **check)
    with pytest.raises(PreflightError, match=r"x 2 ranks"):
        preflight.check_run(plan=node, available_bytes=one_new, **check)


def test_a_saves_buffer_is_counted_as_the_largest_tensor_the_writer_copies(tmp_path) -> None:
    """Issue 33 item 4: a save adds one tensor's copy at most, and preflight counts it. The
    bound follows the writer: a tensor `layout.tensor_bytes` writes from its own memory
    costs nothing, one it casts is the copy counted."""
    from lazytrain_accel.checkpoints import layout
    from lazytrain_accel.run import setup

    model = tiny_model()
    largest = max(p.numel() for p in model.parameters())
    for name, dtype in layout.CHECKPOINT_DTYPES.items():
        copies = [p for p in model.parameters()
                  if not _shares_memory(p, layout.tensor_bytes(p, dtype))]
        bound = preflight.save_buffer_bytes(model, checkpoint_dtype=name,
                                            resident_update="host")
        expected = max((p.numel() * layout.export_dtype(p, dtype).itemsize for p in copies),
                       default=0)
        assert bound == expected, name
    assert preflight.save_buffer_bytes(model, checkpoint_dtype="bfloat16",
                                       resident_update="host") == 2 * largest
    # On the device every tensor is read off it: the largest fp32 master, copied.
    assert preflight.save_buffer_bytes(model, checkpoint_dtype="auto",
                                       resident_update="device") == 4 * largest

    plan = Plan.load(plan_json(tmp_path, model, Home.CPU))
    profile = setup.profile_for_run(model, batch_size=plan.batch_size, seq_len=plan.seq_len,
                                    compute_dtype=None)
    check = {"model": model, "plan": plan, "model_profile": profile, "optimizer": "keep",
             "nvme_dir": str(tmp_path / "nvme")}
    as_held = preflight.check_run(checkpoint_dtype="auto", available_bytes=1 << 40, **check)
    assert dict(as_held.terms)[preflight.SAVE_BUFFER_TERM] == 0
    exported = preflight.check_run(checkpoint_dtype="bfloat16", available_bytes=1 << 40,
                                   **check)
    assert exported.new_bytes == as_held.new_bytes + 2 * largest
    with pytest.raises(PreflightError, match="checkpoint save buffer"):
        preflight.check_run(checkpoint_dtype="bfloat16", available_bytes=as_held.new_bytes,
                            **check)


def _shares_memory(tensor: torch.Tensor, data: memoryview) -> bool:
    """Whether the writer's bytes are `tensor`'s own memory (no copy)."""
    return torch.frombuffer(data, dtype=torch.uint8).data_ptr() == tensor.data_ptr()


def test_several_drives_are_checked_each_for_its_share(tmp_path) -> None:
    """`nvme_dir` naming one directory per drive: each drive must hold its layers' share
    (layer j on directory j % D); directories on one file system share its free space."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm as a file system apart from the test's directory")
    small = Path(tempfile.mkdtemp(prefix="lazytrain-drive-", dir=shm))
    try:
        over_small = 2 * (shutil.disk_usage(small).free + GIB)  # half of it: too much there
        if over_small // 2 >= shutil.disk_usage(tmp_path).free:
            pytest.skip("the test's drive is not larger than /dev/shm")
        with pytest.raises(PreflightError, match=f"nvme_dir '{small}' has"):
            preflight.check_nvme_dir(f"{tmp_path / 'a'},{small}", need_bytes=over_small,
                                     num_layers=4)
        # four layers over three directories: one on the first (layer 3), two, one
        preflight.check_nvme_dir(f"{small},{tmp_path / 'a'},{tmp_path / 'b'}",
                                 need_bytes=over_small, num_layers=4)
    finally:
        shutil.rmtree(small)
    free = shutil.disk_usage(tmp_path).free
    # each half fits the drive, both together do not
    with pytest.raises(PreflightError, match=f"nvme_dir '{tmp_path / 'a'}' and "
                                             f"'{tmp_path / 'b'}' has"):
        preflight.check_nvme_dir(f"{tmp_path / 'a'},{tmp_path / 'b'}",
                                 need_bytes=int(1.5 * free), num_layers=4)
