"""The kernel's torch-free core (csrc/adamw8bit_core.h) computes reference.py's bits on
aarch64 too: core_check.cpp is cross-compiled for aarch64 and run under qemu on fixtures
this process writes; the same program built for this machine is checked alongside."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from lazytrain_accel.optim import native, reference
from lazytrain_accel.optim.codes import num_blocks

_PROGRAM = Path(__file__).with_name("core_check.cpp")
#: the kernel's own flags (its `omp simd` loops vectorized as in the extension), linked
#: statically so that qemu needs no aarch64 libraries
_FLAGS = [*native.KERNEL_CFLAGS, "-static", "-I", str(native.CORE_HEADER.parent)]
#: target: (compiler, extra flags, how to run the binary); the host's portable loops, and
#: the hand-vectorized AVX2 ones (adamw8bit_avx2.h) where this CPU runs them
_TARGETS = {
    "aarch64": ("aarch64-linux-gnu-g++", ["-march=armv8-a"], ["qemu-aarch64"]),
    "host": ("g++", [], []),
}
if "avx2" in {v.name for v in native.runnable_variants()}:
    _TARGETS["host-avx2"] = ("g++", list(native.variant_named("avx2").cflags), [])
_MISSING = ("needs {tool}: apt-get install g++-aarch64-linux-gnu qemu-user (what .ci/run "
            "installs) to check the kernel's arithmetic on Arm")


@pytest.fixture(scope="module", params=sorted(_TARGETS))
def core_program(request, tmp_path_factory) -> list[str]:
    """The command that runs core_check built for one target."""
    compiler, flags, runner = _TARGETS[request.param]
    for tool in (compiler, *runner[:1]):
        if shutil.which(tool) is None:
            pytest.skip(_MISSING.format(tool=tool))
    binary = tmp_path_factory.mktemp("core") / f"core_check_{request.param}"
    subprocess.run([compiler, *_FLAGS, *flags, str(_PROGRAM), "-o", str(binary)], check=True)
    return [*runner, str(binary)]


def _state_after_steps(numel: int, block_size: int, steps: int) -> tuple[torch.Tensor, dict]:
    """A master and 8-bit state after `steps` reference steps: codes spread over the range."""
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(numel, generator=gen)
    blocks = num_blocks(numel, block_size)
    state = {"exp_avg_codes": torch.zeros(numel, dtype=torch.uint8),
             "exp_avg_sq_codes": torch.zeros(numel, dtype=torch.uint8),
             "exp_avg_absmax": torch.zeros(blocks), "exp_avg_sq_absmax": torch.zeros(blocks)}
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 4
        reference.adamw8bit_update_(master, grad, state, _scalars(step), block_size=block_size)
    return master, state


def _scalars(step: int) -> reference.AdamStepScalars:
    return reference.AdamStepScalars(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                     weight_decay=0.1, step=step, clip_coef=0.75)


def _fixture(master, grad, state, s, block_size) -> bytes:
    """core_check's stdin (its header comment): scalars rounded to fp32 as the binding does."""
    header = struct.pack("<4q", master.numel(), block_size, grad.dtype == torch.bfloat16, 1)
    scalars = struct.pack("<9f", s.beta1, 1.0 - s.beta1, s.beta2, 1.0 - s.beta2, s.eps,
                          s.decay, s.step_size, s.inv_bias_correction2_sqrt, s.clip_coef)
    arrays = [master, grad, state["exp_avg_codes"], state["exp_avg_sq_codes"],
              state["exp_avg_absmax"], state["exp_avg_sq_absmax"]]
    return header + scalars + b"".join(a.contiguous().numpy().tobytes() if a.dtype !=
                                       torch.bfloat16 else a.view(torch.int16).numpy().tobytes()
                                       for a in arrays)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_core_matches_reference_bit_for_bit(core_program, grad_dtype) -> None:
    block_size, numel = 256, 3 * 256 + 77  # a partial last block
    master, state = _state_after_steps(numel, block_size, steps=3)
    grad = (torch.randn(numel, generator=torch.Generator().manual_seed(9)) * 1e-2).to(grad_dtype)
    fixture = _fixture(master, grad, state, _scalars(4), block_size)
    out = subprocess.run(core_program, input=fixture, capture_output=True, check=True).stdout
    expected_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    reference.adamw8bit_update_(master, grad, state, _scalars(4), block_size=block_size,
                                out_bf16=expected_bf16)
    expected = b"".join(t.numpy().tobytes() for t in (
        master, state["exp_avg_codes"], state["exp_avg_sq_codes"], state["exp_avg_absmax"],
        state["exp_avg_sq_absmax"], expected_bf16.view(torch.int16)))
    assert len(out) == len(expected)
    assert out == expected, "the core's step differs from reference.py's bits"
