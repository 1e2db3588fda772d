"""step_layerwise: a layer-by-layer update on a thread equals a whole-model step."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import batches, build_model, make_plan, twin
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lazytrain_accel.engine import attach

CPU = torch.device("cpu")
LR = 1e-2


class LayeredSGD(torch.optim.Optimizer):
    """Stand-in with the per-layer protocol; records which groups it stepped, in order."""

    def __init__(self, params, *, allow: bool = True) -> None:
        super().__init__(params, {"lr": LR})
        self.allow = allow
        self.calls: list[list[nn.Parameter]] = []
        self.threads: set[str] = set()
        self.sq_norms: dict[nn.Parameter, float] = {}

    def set_grad_sq_norms(self, sq_norms):
        self.sq_norms = dict(sq_norms)

    def begin_step(self) -> bool:
        return self.allow

    @torch.no_grad()
    def step_params(self, params, *, out_bf16=None) -> None:
        self.calls.append(list(params))
        self.threads.add(threading.current_thread().name)
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)

    def end_step(self) -> None:
        pass


def _train(model, step_fn, zero_fn, steps: int = 3):
    for step, ids in enumerate(batches(steps)):
        torch.manual_seed(step)
        model(input_ids=ids, labels=ids).loss.backward()
        step_fn()
        zero_fn()


def test_layerwise_update_matches_a_plain_step_in_forward_order(tmp_path):
    ref = build_model("qwen2", 10)
    model = twin(ref)
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = LayeredSGD(model.parameters())
    ref.config.use_cache = False
    _train(ref, opt_ref.step, opt_ref.zero_grad)
    # model.zero_grad() right after the threaded step is deferred, not destructive
    _train(model, lambda: engine.step_layerwise(opt), lambda: model.zero_grad())
    engine.synchronize()
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)
        assert p.grad is None  # the deferred zero_grad cleared every group after its update
    groups = opt.calls[:12]  # embeddings, layers 1..10, final norm and untied head
    assert groups[0] == [model.model.embed_tokens.weight]
    assert groups[1:11] == [engine.layer_params(j) for j in range(1, 11)]
    assert groups[11] == [model.model.norm.weight, model.lm_head.weight]
    assert opt.threads == {"lazytrain-step"}
    assert set(opt.sq_norms) == set(model.parameters())


def test_engine_norms_equal_the_accumulated_gradients(tmp_path):
    model = build_model("gpt2", 4)
    engine = attach(model, make_plan("offload_all", 4), device=CPU, nvme_dir=str(tmp_path))
    for ids in batches(2):  # two micro-batches accumulate
        model(input_ids=ids, labels=ids).loss.backward()
    norms = engine.grad_sq_norms()
    assert set(norms) == {p for p in model.parameters() if p.grad is not None}
    for p, sq in norms.items():
        torch.testing.assert_close(torch.tensor(sq), p.grad.pow(2).sum(), rtol=1e-5, atol=1e-9)


def test_a_skipped_step_changes_nothing(tmp_path):
    model = build_model("llama", 4)
    engine = attach(model, make_plan("checkpoint_all", 4), device=CPU, nvme_dir=str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    opt = LayeredSGD(model.parameters(), allow=False)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    engine.step_layerwise(opt)
    engine.synchronize()
    assert opt.calls == []
    for b, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(b, p)


def test_hybrid_adamw8bit_layerwise_equals_its_own_step(tmp_path):
    from lazytrain_accel.optim import HybridAdamW8bit

    ref = build_model("qwen2", 10)
    model = twin(ref)
    ref_engine = attach(ref, make_plan("checkpoint_all", 10), device=CPU,
                        nvme_dir=str(tmp_path))
    engine = attach(model, make_plan("mixed", 10), device=CPU, nvme_dir=str(tmp_path))
    opt_ref = HybridAdamW8bit(ref.parameters(), lr=LR, max_grad_norm=1.0)
    opt = HybridAdamW8bit(model.parameters(), lr=LR, max_grad_norm=1.0)
    _train(ref, opt_ref.step, opt_ref.zero_grad)  # whole step, norms measured by the optimizer
    _train(model, lambda: engine.step_layerwise(opt), lambda: opt.zero_grad())
    engine.synchronize()
    ref_engine.synchronize()
    assert opt.last_grad_norm is not None
    torch.testing.assert_close(opt.last_grad_norm, opt_ref.last_grad_norm, rtol=1e-5, atol=0)
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)


def test_grad_ready_hook_sees_each_layer_once_as_its_backward_ends(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))
    seen: list[list[nn.Parameter]] = []
    engine.register_grad_ready_hook(lambda params: seen.append(list(params)))
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == [engine.layer_params(j) for j in (4, 3, 2, 1)]
    assert all(p.grad is not None for params in seen for p in params)


class _MasterCasts(TorchDispatchMode):
    """Counts fp32 -> compute-dtype copies read from decoder-layer masters (this thread)."""

    def __init__(self, master_ptrs: set[int]) -> None:
        super().__init__()
        self.ptrs, self.casts = master_ptrs, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if src.dtype == torch.float32 and src.untyped_storage().data_ptr() in self.ptrs:
                self.casts += 1
        return func(*args, **kwargs)


def test_bf16_copies_come_out_of_the_update_and_go_stale_on_an_edit(tmp_path):
    from lazytrain_accel.optim import HybridAdamW8bit

    model = build_model("llama", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU,
                    compute_dtype=torch.bfloat16, nvme_dir=str(tmp_path))
    opt = HybridAdamW8bit(model.parameters(), lr=LR)
    ids = batches(1)[0]
    masters = {p.untyped_storage().data_ptr() for j in range(1, 5)
               for p in engine.layer_params(j)}
    with _MasterCasts(masters) as first:  # no copies yet: layers cast from their masters
        model(input_ids=ids, labels=ids).loss.backward()
    assert first.casts > 0
    engine.step_layerwise(opt)
    engine.synchronize()
    for j in range(1, 5):
        expected = torch.cat([p.detach().reshape(-1) for p in engine.layer_params(j)])
        assert torch.equal(engine.pool._fresh_copy(j), expected.to(torch.bfloat16))
    with _MasterCasts(masters) as second:  # forward, recompute, backward: all from copies
        model(input_ids=ids, labels=ids).loss.backward()
    assert second.casts == 0
    with torch.no_grad():
        engine.layer_params(2)[0].mul_(0.5)  # an edit the copy does not have
    assert engine.pool._fresh_copy(2) is None and engine.pool._fresh_copy(3) is not None


def test_a_whole_step_of_the_hybrid_operator_leaves_the_copies_stale(tmp_path):
    """An update of every parameter at once (the step not overlapped) writes no compute
    copy: the masters' versions change (the operator writes through `.data` and bumps
    them), so copies an earlier layer-wise update wrote are cast again, not streamed."""
    from lazytrain_accel.optim import HybridAdamW8bit

    model = build_model("llama", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU,
                    compute_dtype=torch.bfloat16, nvme_dir=str(tmp_path))
    opt = HybridAdamW8bit(model.parameters(), lr=LR)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    engine.step_layerwise(opt)
    engine.synchronize()
    assert all(engine.pool._fresh_copy(j) is not None for j in range(1, 5))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(engine.pool._fresh_copy(j) is None for j in range(1, 5))


def test_a_layer_received_from_another_node_streams_its_copy_alone(tmp_path):
    """The split layout below fp32 compute: a layer whose masters another node holds is
    streamed from the compute copy received into (`receive_copies`), never cast, its
    masters placeholders; the update writes no copy of it; a checkpoint loads into it
    (`received_views`); a layer this rank sends is its masters' cast."""
    from lazytrain_accel.distributed.node_store import placeholder

    model = build_model("llama", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU,
                    compute_dtype=torch.bfloat16, nvme_dir=str(tmp_path))
    ids = batches(1)[0]
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss
    received = torch.cat([p.detach().reshape(-1) for p in engine.layer_params(2)]
                         ).to(torch.bfloat16)
    engine.pool.receive_copies({2: received})
    for p in engine.layer_params(2):
        p.data = placeholder(p)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids).loss, expected)
    assert engine.pool.compute_copy(2) is None
    assert engine.pool.exchanged_copy(2) is received
    views = engine.pool.received_views()
    assert set(views) == set(engine.layer_params(2))
    assert all(v.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
               for v in views.values())
    sent = torch.cat([p.detach().reshape(-1) for p in engine.layer_params(3)])
    assert torch.equal(engine.pool.exchanged_copy(3), sent.to(torch.bfloat16))
    with pytest.raises(ValueError, match="given copy"):
        engine.pool.receive_copies({3: received[1:]})  # not that layer's size


class _HeadGate(LayeredSGD):
    """Holds the update of the output side (`head`) until layer 1 of the next forward ran."""

    def __init__(self, params, head: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.head = head
        self.layer1_ran = threading.Event()
        self.timed_out = False

    def step_params(self, params, *, out_bf16=None) -> None:
        if list(params) == self.head:
            self.timed_out = not self.layer1_ran.wait(timeout=10.0)
        super().step_params(params, out_bf16=out_bf16)


def test_the_head_is_updated_last_and_the_next_forward_does_not_wait_for_it(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path))
    head = [model.model.norm.weight, model.lm_head.weight]
    opt = _HeadGate(model.parameters(), head)
    updates_before_head: list[int] = []
    model.model.layers[0].register_forward_hook(lambda *_: opt.layer1_ran.set())
    model.lm_head.register_forward_pre_hook(lambda *_: updates_before_head.append(len(opt.calls)))
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.layer1_ran.clear()
    engine.step_layerwise(opt)
    model(input_ids=ids, labels=ids).loss.backward()
    engine.synchronize()
    assert not opt.timed_out  # layer 1 ran while the head's update was held back
    assert opt.calls == [[model.model.embed_tokens.weight],
                         *(engine.layer_params(j) for j in range(1, 5)), head]
    assert updates_before_head == [0, 6]  # the second forward's head ran after its update


def _with_device_residents(plan):
    import dataclasses

    return dataclasses.replace(plan, resident_update="device")


@pytest.mark.parametrize(("compute_dtype", "emulated"), [(torch.float32, False),
                                                       (torch.bfloat16, False),
                                                       (torch.bfloat16, True)])
def test_residents_updated_on_the_device_train_like_the_host_update(tmp_path, compute_dtype,
                                                                     emulated):
    """resident_update="device": the residents' update runs on the training thread, the
    layers on the update thread; on a synchronous CPU device before that thread starts, on
    an async one (the emulated device, as a GPU) beside it: the two overlap. Same bits as
    the host-only update, gradients cleared after each step."""
    from lazytrain_accel.engine.device.emulation import EmulationSettings
    from lazytrain_accel.optim import HybridAdamW8bit

    ref = build_model("qwen2", 4)
    model = twin(ref)
    ref_engine = attach(ref, make_plan("offload_all", 4), device=CPU,
                        compute_dtype=compute_dtype, nvme_dir=str(tmp_path), emulation=False)
    engine = attach(model, _with_device_residents(make_plan("offload_all", 4)), device=CPU,
                    compute_dtype=compute_dtype, nvme_dir=str(tmp_path),
                    emulation=EmulationSettings(seed=3) if emulated else False)
    assert engine.steps.device_update_beside_host == emulated  # the backend decides
    opt_ref = HybridAdamW8bit(ref.parameters(), lr=LR, max_grad_norm=1.0)
    opt = HybridAdamW8bit(model.parameters(), lr=LR, max_grad_norm=1.0)
    stepped_on: dict[str, set[int]] = {}
    step_params = opt.step_params
    first_layer = engine.layer_params(1)[0]
    rounds: list[tuple[threading.Event, threading.Event]] = []  # per step: who is inside
    overlapped: list[bool] = []

    def recording(params, **kwargs):
        where = stepped_on.setdefault(threading.current_thread().name, set())
        where.update(id(p) for p in params if p.grad is not None)
        residents_in, layer_in = rounds[-1]
        if threading.current_thread() is threading.main_thread():
            residents_in.set()
            # beside: the thread is inside layer 1's update while this one is in progress
            overlapped.append(layer_in.wait(timeout=10.0 if emulated else 0.3))
        elif params and params[0] is first_layer:
            residents_in.wait(timeout=10.0)
            layer_in.set()
        step_params(params, **kwargs)

    def step() -> None:
        rounds.append((threading.Event(), threading.Event()))  # the last update is over
        engine.step_layerwise(opt)

    opt.step_params = recording
    _train(ref, lambda: ref_engine.step_layerwise(opt_ref), lambda: opt_ref.zero_grad())
    _train(model, step, lambda: opt.zero_grad())
    engine.synchronize()
    ref_engine.synchronize()
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, p_ref)
        assert p.grad is None  # the deferred zero_grad reached the residents too
    assert overlapped == [emulated] * 3  # side by side on the async device only
    residents = {id(p) for p in engine.resident_params()}
    assert stepped_on[threading.current_thread().name] == residents
    assert stepped_on["lazytrain-step"] == {id(p) for j in range(1, 5)
                                            for p in engine.layer_params(j)}
    assert engine.stats().device_update_s > 0
    engine.detach()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_replan_cannot_move_the_residents_update(tmp_path):
    model = build_model("qwen2", 4)
    engine = attach(model, make_plan("offload_all", 4), device=CPU, nvme_dir=str(tmp_path))
    with pytest.raises(ValueError, match="resident_update='host'"):
        engine.set_plan(_with_device_residents(make_plan("offload_all", 4)))
