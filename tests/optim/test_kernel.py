"""The native kernel against the pure-torch reference: identical codes and masters."""

from __future__ import annotations

import pytest
import torch

from lazytrain_accel.optim import HybridAdamW8bit, native

from .helpers import assert_states_equal, make_params, require_kernel, set_random_grads

#: Every vector variant this CPU runs (AVX-512 and AVX2 on an AVX-512 x86, NEON on Arm),
#: each built with its instruction set forced: the one the optimizer picks, and the ones a
#: CPU with fewer features would pick.
_VECTOR_VARIANTS = [v.name for v in native.runnable_variants() if v.name != "portable"]


@pytest.fixture(params=_VECTOR_VARIANTS or ["portable"])
def kernel_variant(request, monkeypatch) -> str:
    """Runs the test with the optimizer's kernel built for one variant."""
    require_kernel()
    kernel = native.load_kernel(request.param)
    assert kernel is not None, f"the {request.param} variant did not build"
    assert kernel.instruction_set == request.param  # its flags were really applied
    monkeypatch.setattr(native, "load_kernel", lambda: kernel)
    return request.param


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_native_matches_reference_bit_for_bit_after_5_steps(grad_dtype, max_grad_norm) -> None:
    require_kernel()
    ref_params, nat_params = make_params(), make_params()
    kwargs = dict(lr=3e-2, weight_decay=0.1, max_grad_norm=max_grad_norm, block_size=256)
    ref = HybridAdamW8bit(ref_params, backend="torch", **kwargs)
    nat = HybridAdamW8bit(nat_params, backend="native", **kwargs)
    assert nat.uses_native_kernel and not ref.uses_native_kernel
    for step in range(5):
        set_random_grads(ref_params, seed=step, dtype=grad_dtype)
        set_random_grads(nat_params, seed=step, dtype=grad_dtype)
        ref.step()
        nat.step()
    assert_states_equal(ref, nat)
    assert "exp_avg_codes" in nat.state[nat_params[0]]  # the 8-bit path was exercised


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("block_size", [1, 100, 4096])
def test_native_matches_reference_for_odd_block_sizes(block_size) -> None:
    require_kernel()
    ref_params, nat_params = make_params(1), make_params(1)
    ref = HybridAdamW8bit(ref_params, backend="torch", block_size=block_size, lr=1e-2)
    nat = HybridAdamW8bit(nat_params, backend="native", block_size=block_size, lr=1e-2)
    for step in range(3):
        set_random_grads(ref_params, seed=step)
        set_random_grads(nat_params, seed=step)
        ref.step()
        nat.step()
    assert_states_equal(ref, nat)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_bf16_compute_copy_is_written_in_the_same_pass(backend) -> None:
    if backend == "native":
        require_kernel()
    params = make_params(2)
    opt = HybridAdamW8bit(params, backend=backend, lr=1e-2)
    set_random_grads(params, seed=0)
    outs = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    assert opt.begin_step()
    opt.step_params(params, out_bf16=outs)
    opt.end_step()
    for p, out in zip(params, outs, strict=True):
        assert torch.equal(out, p.detach().to(torch.bfloat16))


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_every_variant_writes_the_bf16_copy_rounded_to_nearest_even(offset) -> None:
    """The vector variants write the copy with their own loops (AVX2: streaming stores
    where the copy is 32-byte aligned, plain ones elsewhere): each must round as torch."""
    params = make_params(2)
    opt = HybridAdamW8bit(params, backend="native", lr=1e-2)
    set_random_grads(params, seed=0)
    outs = [torch.empty(p.numel() + offset, dtype=torch.bfloat16)[offset:] for p in params]
    assert opt.begin_step()
    opt.step_params(params, out_bf16=outs)
    opt.end_step()
    for p, out in zip(params, outs, strict=True):
        assert torch.equal(out, p.detach().reshape(-1).to(torch.bfloat16))
    # masters on rounding ties (low 16 bits 0x8000), odd and even, kept by lr=0
    gen = torch.Generator().manual_seed(1)
    high = torch.randint(0x3F00, 0x4100, (4099,), generator=gen, dtype=torch.int32)
    ties = torch.nn.Parameter(((high << 16) | 0x8000).view(torch.float32))
    set_random_grads([ties], seed=1)
    opt = HybridAdamW8bit([ties], backend="native", lr=0.0, weight_decay=0.0)
    out = torch.empty(ties.numel() + offset, dtype=torch.bfloat16)[offset:]
    assert opt.begin_step()
    opt.step_params([ties], out_bf16=[out])
    opt.end_step()
    assert torch.equal(out, ties.detach().to(torch.bfloat16))


def test_non_contiguous_compute_copy_is_still_written() -> None:
    params = make_params(3)[:1]
    opt = HybridAdamW8bit(params, lr=1e-2)
    set_random_grads(params, seed=0)
    out = torch.empty(tuple(reversed(params[0].shape)), dtype=torch.bfloat16).t()
    assert opt.begin_step()
    opt.step_params(params, out_bf16=[out])
    opt.end_step()
    assert torch.equal(out, params[0].detach().to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_strided_master_is_updated_like_a_contiguous_one(backend) -> None:
    base = make_params(4)[2]  # (33, 257): a partial last block
    strided = torch.nn.Parameter(base.detach().t().contiguous().t())
    assert not strided.is_contiguous()
    plain = torch.nn.Parameter(base.detach().clone())
    a = HybridAdamW8bit([strided], lr=1e-2, backend=backend)
    b = HybridAdamW8bit([plain], lr=1e-2, backend=backend)
    for step in range(3):
        set_random_grads([strided], seed=step)
        set_random_grads([plain], seed=step)
        a.step()
        b.step()
    assert torch.equal(strided, plain) and not strided.is_contiguous()
