"""Clipping inside the update, engine-provided norms, and skipping non-finite steps."""

from __future__ import annotations

import math

import pytest
import torch

from lazytrain_accel.optim import HybridAdamW8bit, clipping

from .helpers import assert_states_equal, clone_params, make_params, set_random_grads


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_fused_clipping_equals_clip_grad_norm_then_unclipped_step(backend) -> None:
    params = make_params()
    ref_params = clone_params(params)
    ours = HybridAdamW8bit(params, lr=1e-2, max_grad_norm=0.3, backend=backend)
    ref = HybridAdamW8bit(ref_params, lr=1e-2, max_grad_norm=None, backend=backend)
    for step in range(4):
        set_random_grads(params, seed=step)
        set_random_grads(ref_params, seed=step)
        expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm=0.3)
        grads_before = [p.grad.clone() for p in params]
        ours.step()
        ref.step()
        assert ours.last_grad_norm == pytest.approx(float(expected), rel=1e-6)
        for p, g in zip(params, grads_before, strict=True):
            assert torch.equal(p.grad, g), "clipping must not rewrite the gradients"
    assert_states_equal(ours, ref)


def test_norm_below_the_limit_leaves_the_step_unclipped() -> None:
    params, ref_params = make_params(), make_params()
    ours = HybridAdamW8bit(params, max_grad_norm=1e9)
    ref = HybridAdamW8bit(ref_params)
    set_random_grads(params, seed=0)
    set_random_grads(ref_params, seed=0)
    ours.step()
    ref.step()
    assert_states_equal(ours, ref)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_gradient_skips_the_step_and_leaves_state_untouched(bad) -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, lr=1e-2, max_grad_norm=1.0)
    set_random_grads(params, seed=0)
    opt.step()
    masters = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    set_random_grads(params, seed=1)
    params[1].grad[7] = bad
    opt.step()
    assert opt.skipped_steps == 1
    assert not math.isfinite(opt.last_grad_norm)
    for p, m in zip(params, masters, strict=True):
        assert torch.equal(p, m)
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[id(p)][k]), k
    set_random_grads(params, seed=2)
    opt.step()  # training goes on
    assert opt.skipped_steps == 1 and math.isfinite(opt.last_grad_norm)


def test_per_layer_protocol_skips_when_begin_step_says_so() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, max_grad_norm=1.0)
    set_random_grads(params, seed=0)
    params[0].grad[0, 0] = math.inf
    assert opt.begin_step() is False
    before = [p.detach().clone() for p in params]
    opt.step_params(params)
    opt.end_step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert opt.skipped_steps == 1 and not opt.state[params[0]]


def test_check_finite_measures_the_norm_without_clipping_or_engine_norms() -> None:
    """Without clipping and without the engine's norms there is no norm pass (like torch's
    AdamW), unless the LazyTrain step asks for the finite check."""
    params = make_params()
    opt = HybridAdamW8bit(params)
    set_random_grads(params, seed=0)
    params[0].grad[0, 0] = math.nan
    assert opt.begin_step() is True
    opt.end_step()
    assert opt.begin_step(check_finite=True) is False
    assert opt.skipped_steps == 1 and math.isnan(opt.last_grad_norm)


def test_a_skipped_step_needs_no_end_step_before_the_next_one() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, max_grad_norm=1.0)
    set_random_grads(params, seed=0)
    opt.set_grad_sq_norms({params[0]: math.nan})
    assert opt.begin_step() is False  # the engine returns here, without end_step()
    set_random_grads(params, seed=1)
    assert opt.begin_step() is True
    opt.step_params(params)
    opt.end_step()
    assert opt.skipped_steps == 1 and int(opt.state[params[0]]["step"]) == 1


def test_engine_norms_replace_the_measured_ones() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, max_grad_norm=1.0)
    set_random_grads(params, seed=0)
    measured = float(opt.grad_norm())
    opt.zero_grad()
    set_random_grads(params, seed=0)
    # the engine reports norms 4x larger for the first two tensors, true ones for the rest
    sq = {p: float(p.grad.double().pow(2).sum()) for p in params}
    sq[params[0]] *= 16
    sq[params[1]] *= 16
    opt.set_grad_sq_norms({p: sq[p] for p in params[:2]})
    expected = math.sqrt(sum(sq.values()))
    assert float(opt.grad_norm()) == pytest.approx(expected, rel=1e-5)
    assert expected > measured * 1.5
    opt.step()
    assert opt.last_grad_norm == pytest.approx(expected, rel=1e-5)
    assert float(opt.grad_norm()) == pytest.approx(measured, rel=1e-5)  # forgotten after step


def test_engine_reported_non_finite_norm_skips_even_without_clipping() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params)
    set_random_grads(params, seed=0)
    opt.set_grad_sq_norms({params[0]: math.inf})
    opt.step()
    assert opt.skipped_steps == 1 and not opt.state[params[0]]


def test_grad_norm_is_cached_for_the_step_and_handles_bf16_grads() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params)
    set_random_grads(params, seed=0, dtype=torch.bfloat16)
    first = opt.grad_norm()
    assert first is opt.grad_norm() and first.dtype == torch.float32
    expected = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params]))
    assert float(first) == pytest.approx(float(expected), rel=1e-5)


def test_max_grad_norm_is_settable_between_steps() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params)
    set_random_grads(params, seed=0)
    opt.step()
    assert opt.last_grad_norm is None  # no clipping, no norm pass
    opt.max_grad_norm = 0.1
    set_random_grads(params, seed=1)
    opt.step()
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_shared_among_threads_equal_one_foreach_norm_bit_for_bit(dtype) -> None:
    """`tensor_norms` spreads a CPU model's gradients over torch's threads: each tensor's
    norm and their order must stay those of one `torch._foreach_norm` call."""
    gen = torch.Generator().manual_seed(0)
    sizes = [700_001, 5, 300_000, 1 << 20, 4096, 123_457, 1]  # over PARALLEL_NORM_MIN_NUMEL
    grads = [(torch.randn(n, generator=gen) * (i + 1)).to(dtype) for i, n in enumerate(sizes)]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        norms = clipping.tensor_norms(grads)
    finally:
        torch.set_num_threads(threads)
    expected = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    assert len(norms) == len(expected)
    for norm, want in zip(norms, expected, strict=True):
        assert norm.dtype == torch.float32 and torch.equal(norm, want)
