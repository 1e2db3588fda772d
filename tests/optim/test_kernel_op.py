"""The native kernel as a torch.library op: checked by `opcheck`, named in a profiler
trace, one namespace per variant, and run without the GIL."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from lazytrain_accel.optim import HybridAdamW8bit, native, reference
from lazytrain_accel.optim.codes import num_blocks

from .helpers import make_params, require_kernel, set_random_grads

#: The variants whose ops these tests load: the one the optimizer picks and the next best
#: (on an AVX-512 x86: avx512 and avx2), so two variants' ops share this process.
_TWO_VARIANTS = [v.name for v in native.runnable_variants()[:2]]


def _kernel(variant: str | None = None) -> native.NativeKernel:
    require_kernel()
    kernel = native.load_kernel(variant)
    assert kernel is not None, f"the {variant or 'default'} variant did not build"
    return kernel


def _op_args(n: int, *, block_size: int = 256, grad_dtype: torch.dtype = torch.float32,
             out_bf16: bool = True, seed: int = 0) -> tuple:
    """Realistic arguments of one step of an `n`-element tensor (its second step: codes
    and absmax from a first), in the op's order."""
    gen = torch.Generator().manual_seed(seed)
    blocks = num_blocks(n, block_size)
    s = reference.AdamStepScalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.1, step=2, clip_coef=0.5)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype),
            torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            torch.rand(blocks, generator=gen),
            torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            torch.rand(blocks, generator=gen),
            torch.empty(n, dtype=torch.bfloat16) if out_bf16 else None,
            s.beta1, s.beta2, s.eps, s.decay, s.step_size, s.inv_bias_correction2_sqrt,
            s.clip_coef, block_size)


@pytest.mark.parametrize("variant", _TWO_VARIANTS)
@pytest.mark.parametrize(("grad_dtype", "out_bf16"), [(torch.float32, False),
                                                      (torch.bfloat16, True)])
def test_opcheck_passes(variant, grad_dtype, out_bf16) -> None:
    """Schema (the in-place annotations), autograd registration, the fake kernel against
    the real one, and the op traced by AOT autograd with dynamic shapes."""
    op = _kernel(variant).adamw8bit_step
    torch.library.opcheck(op, _op_args(1000, grad_dtype=grad_dtype, out_bf16=out_bf16))


def test_the_fake_kernel_checks_sizes_like_the_real_one() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = _kernel().adamw8bit_step
    args = list(_op_args(1000))
    args[3] = torch.rand(2)  # 4 blocks of 256
    with pytest.raises(RuntimeError, match="one value per block"):
        op(*args)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="one value per block"):
        op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def test_the_codes_constants_come_from_the_op_and_a_mismatch_refuses_to_load(monkeypatch):
    kernel = _kernel()
    ops = getattr(torch.ops, native.op_namespace(native.runnable_variants()[0]))
    assert tuple(ops.kernel_info()[1]) == kernel.code_constants == native._expected_constants()
    assert kernel.max_block_size == 4096
    monkeypatch.setattr(native, "_expected_constants", lambda: (20, 0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"differ from codes\.py"):
        native.load_kernel.__wrapped__()


def test_two_variants_coexist_in_one_process_and_compute_the_same_bits() -> None:
    if len(_TWO_VARIANTS) < 2:
        pytest.skip(f"this CPU runs one variant only ({_TWO_VARIANTS})")
    kernels = [_kernel(name) for name in _TWO_VARIANTS]
    names = [k.adamw8bit_step.name() for k in kernels]
    assert names == [f"lazytrain_{v}::adamw8bit_step" for v in _TWO_VARIANTS]
    assert [k.instruction_set for k in kernels] == _TWO_VARIANTS
    results = []
    for kernel in kernels:
        args = _op_args(5000, grad_dtype=torch.bfloat16)
        kernel.adamw8bit_step(*args)
        results.append([a for a in args if isinstance(a, torch.Tensor)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", _TWO_VARIANTS)
def test_a_profiler_trace_of_one_step_names_the_op(variant, monkeypatch) -> None:
    kernel = _kernel(variant)
    monkeypatch.setattr(native, "load_kernel", lambda: kernel)
    params = make_params()
    opt = HybridAdamW8bit(params, backend="native")
    set_random_grads(params, seed=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    counts = {e.key: e.count for e in prof.key_averages()}
    eight_bit = sum("exp_avg_codes" in opt.state[p] for p in params)
    assert eight_bit == 3
    assert counts.get(f"lazytrain_{variant}::adamw8bit_step") == eight_bit, sorted(counts)


def test_the_op_on_an_update_thread_is_in_a_trace_of_all_threads(monkeypatch) -> None:
    """The engine updates on its own thread: the profiler sees that thread's ops only with
    `profile_all_threads` (docs/optimizer.md "The op")."""
    kernel = _kernel()
    monkeypatch.setattr(native, "load_kernel", lambda: kernel)
    params = make_params()
    opt = HybridAdamW8bit(params, backend="native")
    set_random_grads(params, seed=0)
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        assert opt.begin_step()
        worker = threading.Thread(target=opt.step_params, args=(params,))
        worker.start()
        worker.join()
        opt.end_step()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get(kernel.adamw8bit_step.name()) == 3, sorted(counts)


def _seen_mid_update(call: Callable[[], None], master: torch.Tensor, *,
                     tries: int = 10) -> bool:
    """Whether this thread ran Python while `call` (on another thread) was updating
    `master`: it polls 64 elements spread over `master`, each poll one `tolist()` of a
    memoryview (C code that holds the GIL throughout, so a poll never interleaves with
    GIL-holding code); some changed and some not is a state the update only leaves mid-way.
    Were the GIL held for the whole update, every poll would see none or all changed."""
    probes = memoryview(master.numpy())[::master.numel() // 64]
    for _ in range(tries):
        before = probes.tolist()
        worker = threading.Thread(target=call)
        worker.start()
        seen = False
        while worker.is_alive() and not seen:
            changed = sum(a != b for a, b in zip(probes.tolist(), before, strict=True))
            seen = 0 < changed < len(before)
        worker.join()
        assert all(a != b for a, b in zip(probes.tolist(), before, strict=True))
        if seen:
            return True
    return False


def test_the_op_releases_the_gil_while_it_runs() -> None:
    """The engine's update thread runs the kernel while the training thread runs Python:
    torch.ops must release the GIL for the op's whole duration, as the pybind binding did.
    Checked the other way once: a C++ caller holding the GIL through the same op was
    never seen mid-update."""
    kernel = _kernel()
    args = _op_args(1 << 23, out_bf16=False)  # 8M elements: ~20 ms, thousands of polls
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core stays free for the polling thread
    try:
        assert _seen_mid_update(lambda: kernel.adamw8bit_step(*args), args[0])
    finally:
        torch.set_num_threads(threads)
