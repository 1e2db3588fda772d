"""The 8-bit update of a device master (the residents' update on the GPU): the torch path
in whole-block chunks computes the bits of one pass; its cost constants track the code."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lazytrain_accel.optim import reference
from lazytrain_accel.optim.codes import num_blocks
from lazytrain_accel.optim.hybrid_adamw8bit import _update_in_chunks
from lazytrain_accel.profiling.hardware import DEVICE_UPDATE_BYTES_PER_PARAM

SCALARS = reference.AdamStepScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.01, step=3, clip_coef=0.37)


def _state(numel: int, block_size: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = num_blocks(numel, block_size)
    return {"exp_avg_codes": torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen),
            "exp_avg_absmax": torch.rand(blocks, generator=gen) * 1e-2,
            "exp_avg_sq_codes": torch.randint(0, 128, (numel,), dtype=torch.uint8,
                                              generator=gen),
            "exp_avg_sq_absmax": torch.rand(blocks, generator=gen) * 1e-4}


def test_chunks_compute_the_bits_of_one_pass() -> None:
    numel, block_size = 10 * 256 + 77, 256  # a partial last block
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).to(torch.bfloat16)
    one, chunked = master.clone(), master.clone()
    state_one, state_chunked = _state(numel, block_size, 1), _state(numel, block_size, 1)
    out_one = torch.empty(numel, dtype=torch.bfloat16)
    out_chunked = torch.empty(numel, dtype=torch.bfloat16)
    reference.adamw8bit_update_(one, grad, state_one, SCALARS, block_size=block_size,
                                out_bf16=out_one)
    _update_in_chunks(chunked, grad, state_chunked, SCALARS, block_size, out_chunked,
                      chunk_elements=3 * 256 + 5)  # rounds down to whole blocks
    assert torch.equal(one, chunked)
    assert torch.equal(out_one, out_chunked)
    for name in state_one:
        assert torch.equal(state_one[name], state_chunked[name]), name


class _BytesMoved(TorchDispatchMode):
    """Bytes every op reads and writes (views excluded): a bandwidth-bound device's cost."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(word in str(func) for word in ("view", "slice", "alias", "select",
                                                  "detach", "reshape")):
            tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0]
                       if isinstance(t, torch.Tensor)]
            self.nbytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def test_the_device_update_cost_constants_track_the_torch_path() -> None:
    numel, block_size = 2**18, 256
    master = torch.randn(numel)
    grad = torch.randn(numel).to(torch.bfloat16)
    with _BytesMoved() as moved:
        reference.adamw8bit_update_(master, grad, _state(numel, block_size, 2), SCALARS,
                                    block_size=block_size,
                                    out_bf16=torch.empty(numel, dtype=torch.bfloat16))
    per_param = moved.nbytes / numel
    assert 0.9 * DEVICE_UPDATE_BYTES_PER_PARAM <= per_param <= 1.1 * DEVICE_UPDATE_BYTES_PER_PARAM
