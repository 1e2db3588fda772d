"""The 8-bit float codes: exact round trips, bounded error, blockwise scaling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain_accel.optim.codes import (
    EXP_AVG_CODE,
    EXP_AVG_SQ_CODE,
    decode,
    dequantize_blockwise,
    encode,
    num_blocks,
    quantize_blockwise,
)

CODES = [EXP_AVG_CODE, EXP_AVG_SQ_CODE]


@pytest.mark.parametrize("code", CODES)
def test_every_code_decodes_to_a_value_that_encodes_back(code) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    if code.signed:
        codes = codes[codes != 0x80]  # "-0" decodes to +0, which encodes as 0
    assert torch.equal(encode(decode(codes, code), code), codes)


@pytest.mark.parametrize("code", CODES)
def test_decoded_values_are_sorted_and_span_the_documented_range(code) -> None:
    magnitudes = decode(torch.arange(code.max_code + 1, dtype=torch.uint8), code)
    assert magnitudes[0] == 0 and magnitudes[-1] == 1.0
    assert bool((magnitudes[1:] > magnitudes[:-1]).all())
    assert magnitudes[1] == code.smallest_positive
    assert math.floor(-math.log2(code.smallest_positive)) == (15 if code.signed else 31)


@pytest.mark.parametrize("code", CODES)
def test_relative_rounding_error_is_at_most_half_a_mantissa_step(code) -> None:
    torch.manual_seed(0)
    values = torch.rand(100_000) * (1 - code.smallest_positive * 4) + code.smallest_positive * 4
    values = values ** 6  # spread over many binades
    values = values[values > code.smallest_positive * 2]
    back = decode(encode(values, code), code)
    relative = ((back - values).abs() / values).max()
    assert relative <= 2.0 ** -(code.mantissa_bits + 1) + 1e-7


def test_signed_code_keeps_the_sign_and_tiny_values_decode_to_exact_zero() -> None:
    values = torch.tensor([-1.0, -0.25, -0.0, 0.0, 0.25, 1.0, -1e-12, 1e-12])
    codes = encode(values, EXP_AVG_CODE)
    assert codes[3] == 0 and codes[7] == 0 and codes[2] == 0x80 and codes[6] == 0x80
    decoded = decode(codes, EXP_AVG_CODE)
    assert torch.equal(decoded, torch.tensor([-1, -0.25, 0, 0, 0.25, 1, 0, 0.0]))
    assert not torch.signbit(decoded[2:4]).any() and not torch.signbit(decoded[6:]).any()


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 1000), block_size=st.sampled_from([1, 7, 64, 256]),
       scale_exp=st.integers(-30, 30), signed=st.booleans())
def test_blockwise_round_trip_is_exact_at_each_block_max(numel, block_size, scale_exp, signed):
    code = EXP_AVG_CODE if signed else EXP_AVG_SQ_CODE
    gen = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=gen) * 2.0**scale_exp
    if not signed:
        values = values.abs()
    codes, absmax = quantize_blockwise(values, code, block_size)
    assert codes.dtype == torch.uint8 and codes.numel() == numel
    assert absmax.numel() == num_blocks(numel, block_size)
    back = dequantize_blockwise(codes, absmax, code, block_size)
    assert back.shape == values.shape
    # elements far below their block's absmax may flush to zero; others keep 3 bits
    padded = torch.nn.functional.pad(values, (0, absmax.numel() * block_size - numel))
    block_max = padded.view(-1, block_size).abs().amax(1).repeat_interleave(block_size)[:numel]
    kept = values.abs() >= block_max * code.smallest_positive * 2
    error = (back - values).abs()[kept]
    assert bool((error <= values.abs()[kept] * (2.0**-4 + 1e-6)).all())
    assert torch.equal(back.abs().view(-1).max(), values.abs().max())


def test_all_zero_block_stays_zero() -> None:
    codes, absmax = quantize_blockwise(torch.zeros(300), EXP_AVG_CODE, 256)
    assert int(codes.sum()) == 0 and float(absmax.sum()) == 0
    assert float(dequantize_blockwise(codes, absmax, EXP_AVG_CODE, 256).abs().sum()) == 0
