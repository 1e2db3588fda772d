"""Blockwise 8-bit float codes for the Adam moments, computed with integer bit tricks.

A code is a small float: the value of each element divided by its block's absmax (so it
lies in [-1, 1]) keeps its fp32 exponent and its top `mantissa_bits` mantissa bits,
rounded to nearest. Because fp32 bits are ordered like the values they encode, rounding
is one integer add and one shift of the fp32 bit pattern; decoding is a shift back. No
table search per element (bitsandbytes' dynamic map needs one), which is what lets the
fused update run at memory speed. `docs/optimizer.md` has the measurements that chose it.

* first moment (signed): 1 sign bit + 7 magnitude bits, e4m3 -> 2^-15 .. 1 of the absmax.
* second moment (unsigned, >= 0): 8 magnitude bits, e5m3 -> 2^-31 .. 1 of the absmax
  (v spans twice the binades of the gradients it squares).

Codes 0 (and 0x80, a signed "-0") are exactly 0. The native kernel (`csrc/adamw8bit.cpp`)
implements the same arithmetic; these torch functions are its oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FP32_MANTISSA_BITS = 23
_FP32_ONE_BITS = 0x3F800000
_ABS_MASK = 0x7FFFFFFF


@dataclass(kw_only=True, frozen=True)
class FloatCode:
    """An 8-bit float code: `magnitude_bits` of exponent+mantissa, optionally a sign bit."""

    mantissa_bits: int
    signed: bool

    @property
    def magnitude_bits(self) -> int:
        return 7 if self.signed else 8

    @property
    def shift(self) -> int:
        """Right shift taking fp32 bits to (exponent, top mantissa bits)."""
        return _FP32_MANTISSA_BITS - self.mantissa_bits

    @property
    def max_code(self) -> int:
        return (1 << self.magnitude_bits) - 1

    @property
    def offset(self) -> int:
        """Subtracted after the shift so that the value 1.0 gets the largest code."""
        return (_FP32_ONE_BITS >> self.shift) - self.max_code

    @property
    def smallest_positive(self) -> float:
        """Smallest nonzero magnitude relative to the absmax (code 1)."""
        bits = torch.tensor([(1 + self.offset) << self.shift], dtype=torch.int32)
        return float(bits.view(torch.float32))


#: First moment: signed e4m3.
EXP_AVG_CODE = FloatCode(mantissa_bits=3, signed=True)
#: Second moment: unsigned e5m3.
EXP_AVG_SQ_CODE = FloatCode(mantissa_bits=3, signed=False)


def encode(normalized: torch.Tensor, code: FloatCode) -> torch.Tensor:
    """uint8 codes of fp32 values in [-1, 1] (values beyond clamp to the largest code)."""
    bits = normalized.contiguous().view(torch.int32)
    magnitude = bits & _ABS_MASK
    rounded = (magnitude + (1 << (code.shift - 1))) >> code.shift
    codes = (rounded - code.offset).clamp_(0, code.max_code)
    if code.signed:
        # the sign bit of fp32 moves to bit 7; a zero magnitude may keep it ("-0", 0x80),
        # which decodes to 0 like code 0 and saves the kernel a select per element
        codes = codes | ((bits >> 24) & 0x80)
    return codes.to(torch.uint8)


def decode(codes: torch.Tensor, code: FloatCode) -> torch.Tensor:
    """fp32 values in [-1, 1] of uint8 codes."""
    as_int = codes.to(torch.int32)
    magnitude = as_int & code.max_code
    bits = (magnitude + code.offset) << code.shift
    if code.signed:
        bits = bits | ((as_int & 0x80) << 24)
    values = bits.view(torch.float32)
    return torch.where(magnitude == 0, torch.zeros_like(values), values)


def num_blocks(numel: int, block_size: int) -> int:
    """Number of blocks (each with one fp32 absmax) covering `numel` elements."""
    return -(-numel // block_size)


def _padded_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """(blocks, block_size) view of a flat tensor, zero padded at the end."""
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def quantize_blockwise(
    values: torch.Tensor, code: FloatCode, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped like `values.flatten()`, fp32 absmax per block)."""
    flat = values.detach().reshape(-1).float()
    blocks = _padded_blocks(flat, block_size)
    absmax = blocks.abs().amax(dim=1)
    # multiply by the reciprocal, as the kernel does: one division per block, not per element
    inverse = torch.where(absmax > 0, torch.reciprocal(absmax), torch.zeros_like(absmax))
    normalized = blocks * inverse[:, None]
    codes = encode(normalized, code).reshape(-1)[: flat.numel()]
    return codes, absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: FloatCode, block_size: int
) -> torch.Tensor:
    """Flat fp32 values of blockwise codes."""
    numel = codes.numel()
    normalized = _padded_blocks(decode(codes, code), block_size)
    return (normalized * absmax[:, None]).reshape(-1)[:numel]
