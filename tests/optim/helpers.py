"""Shared helpers of the optimizer tests: seeded models, gradients and state comparison."""

from __future__ import annotations

import shutil

import pytest
import torch

from lazytrain_accel.optim import load_kernel


def require_kernel() -> None:
    """Fail (never skip) when a compiler exists but the kernel does not build."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the native kernel cannot exist here")
    assert load_kernel() is not None, "a C++ compiler exists but the native kernel failed"


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Tensors in transformer-like shapes, with partial last blocks and a small one."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(96, 80), (4099,), (33, 257), (64,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def set_random_grads(params: list[torch.nn.Parameter], seed: int, dtype=torch.float32) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        # heavy-tailed magnitudes so blocks span many binades
        g = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen) ** 4
        if dtype != p.dtype:
            p.grad_dtype = None  # torch >= 2.10 refuses a grad of another dtype otherwise
        p.grad = g.to(dtype)


def clone_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def assert_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """Bitwise equality of two optimizers' states, parameter by parameter, key by key."""
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y), "masters differ"
        sx, sy = a.state[x], b.state[y]
        assert sorted(sx) == sorted(sy)
        for key in sx:
            assert torch.equal(torch.as_tensor(sx[key]), torch.as_tensor(sy[key])), key
