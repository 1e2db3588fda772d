// The block update's two loops written with AVX2 intrinsics. Included by adamw8bit_core.h in
// the AVX2 build only. The compiler's own vectorization of the portable loops works on 32
// uint8 codes at once: it widens bytes to words to dwords with extract/zero-extend pairs,
// widens the byte-wide zero masks the same way, and runs out of the 16 ymm registers
// (spills in the inner loop). Here the moments loop takes 8 lanes of 32 bits (each 8-code
// load is one vpmovzxbd/vpmovsxbd, the decode 5 integer ops for the signed code and 3 for
// the unsigned one), and the encode 16 lanes of 16 bits (the top half of each float holds
// everything the code needs). On a CPU whose vector units are as wide as AVX-512's (Zen 5)
// this build is bound by its instruction count, so every op saved shows.
// Same fp32 operations in the same order as the portable loops (bit for bit; the tests
// compare both with reference.py). Each function returns the first index it left undone:
// the portable loop finishes the tail.
#pragma once

#include <immintrin.h>

namespace lazytrain_core {
namespace avx2 {

inline __m256 load_grad8(const float* g) { return _mm256_loadu_ps(g); }

inline __m256 load_grad8(const uint16_t* g) {  // bf16 bits -> the fp32 they stand for
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Codes widened to dwords: zero-extended for the unsigned code, sign-extended for the
// signed one (bit 7 then fills bits 8..31, which decode_signed8 uses as the float's sign).
inline __m256i load_codes8(const uint8_t* c) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}

inline __m256i load_signed_codes8(const uint8_t* c) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}

// s: sign-extended codes. s << 20 holds the magnitude in bits 20..26 and copies of the
// sign in bits 27..31; keeping bit 31 and bits 20..26 and adding the offset (mag + 889 <
// 2^11: no carry into the sign) gives the float. vpsignd by the magnitude zeroes the
// lanes whose magnitude is 0 (+0.0f, the "-0" code 0x80 included): 5 ops, not 8.
inline __m256 decode_signed8(__m256i s) {
  const __m256i magnitude = _mm256_and_si256(s, _mm256_set1_epi32(0x7F));
  const __m256i u = _mm256_add_epi32(
      _mm256_and_si256(_mm256_slli_epi32(s, kShift),
                       _mm256_set1_epi32(static_cast<int32_t>(0x80000000u | (0x7Fu << kShift)))),
      _mm256_set1_epi32(kSignedOffset << kShift));
  return _mm256_castsi256_ps(_mm256_sign_epi32(u, magnitude));
}

inline __m256 decode_unsigned8(__m256i c) {  // c >= 0: vpsignd zeroes the lanes where c == 0
  const __m256i u = _mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(kUnsignedOffset)),
                                      kShift);
  return _mm256_castsi256_ps(_mm256_sign_epi32(u, c));
}

inline float horizontal_max(__m256 x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float result = lanes[0];
  for (int k = 1; k < 8; ++k) result = std::max(result, lanes[k]);
  return result;
}

// kClip: whether the gradient is scaled (clip_coef != 1; reference.py skips the multiply
// otherwise, so skipping it here is the same bits and one multiply fewer).
template <bool kClip, typename grad_t>
int64_t update_moments(float* __restrict param, const grad_t* __restrict grad,
                       const uint8_t* __restrict m_codes, const uint8_t* __restrict v_codes,
                       float absmax_m, float absmax_v, float* __restrict m_out,
                       float* __restrict v_out, int64_t n, const Scalars& s, float& max_m,
                       float& max_v) {
  const __m256 clip = _mm256_set1_ps(s.clip_coef), am = _mm256_set1_ps(absmax_m),
               av = _mm256_set1_ps(absmax_v), b1 = _mm256_set1_ps(s.beta1),
               omb1 = _mm256_set1_ps(s.one_minus_beta1), b2 = _mm256_set1_ps(s.beta2),
               omb2 = _mm256_set1_ps(s.one_minus_beta2), eps = _mm256_set1_ps(s.eps),
               decay = _mm256_set1_ps(s.decay), step = _mm256_set1_ps(s.step_size),
               ibc2 = _mm256_set1_ps(s.inv_bias_correction2_sqrt),
               abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax_m = _mm256_setzero_ps(), vmax_v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = kClip ? _mm256_mul_ps(load_grad8(grad + i), clip) : load_grad8(grad + i);
    const __m256 m = _mm256_add_ps(
        _mm256_mul_ps(_mm256_mul_ps(decode_signed8(load_signed_codes8(m_codes + i)), am), b1),
        _mm256_mul_ps(g, omb1));
    const __m256 v = _mm256_add_ps(
        _mm256_mul_ps(_mm256_mul_ps(decode_unsigned8(load_codes8(v_codes + i)), av), b2),
        _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
    _mm256_storeu_ps(m_out + i, m);
    _mm256_storeu_ps(v_out + i, v);
    vmax_m = _mm256_max_ps(vmax_m, _mm256_and_ps(m, abs_mask));
    vmax_v = _mm256_max_ps(vmax_v, v);
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
    const __m256 update = _mm256_mul_ps(_mm256_div_ps(m, denom), step);
    _mm256_storeu_ps(param + i,
                     _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(param + i), decay), update));
  }
  max_m = std::max(max_m, horizontal_max(vmax_m));
  max_v = std::max(max_v, horizontal_max(vmax_v));
  return i;
}

// The encode works on the top 16 bits of each scaled moment, 16 lanes a register: the
// code is bits 20..30 of (|y| + half - offset << 20), and the half and the offset have no
// bits below 16, so (top16 & 0x7FFF) - (offset << 4 - 8), clamped at 0 by the unsigned
// saturating subtract, shifted right by 4, is the same code (rounded_magnitude).
// Finite |y| <= 1 (+ one ulp) gives at most 127 (signed) or 255 (unsigned); inf/NaN
// saturate to 0x7F/0xFF (see rounded_magnitude: they need not match codes.py).

// The top halves of a (low word of each dword) and b (high word): 16 lanes, interleaved.
inline __m256i top_halves16(__m256 a, __m256 b) {
  return _mm256_blend_epi16(_mm256_srli_epi32(_mm256_castps_si256(a), 16),
                            _mm256_castps_si256(b), 0xAA);
}

inline __m256i magnitude16(__m256i top, int32_t offset) {
  return _mm256_srli_epi16(
      _mm256_subs_epu16(top, _mm256_set1_epi16(static_cast<int16_t>((offset << 4) - 8))), 4);
}

// Bytes of packus(top_halves16(x0, x1), top_halves16(x2, x3)), per 128-bit lane
// [x0 x1 x0 x1 ... x2 x3 x2 x3 ...] of elements 0..3 (lane 0) and 4..7 (lane 1) -> the 32
// codes in order: the byte shuffle groups each vector's four codes into a dword, the
// dword permute puts the two lanes' halves together.
inline __m256i ordered_codes32(__m256i bytes) {
  const __m256i group = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                         0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  return _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(bytes, group),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256i scaled_top_halves16(const float* x, __m256 scale, int k) {
  return top_halves16(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k), scale),
                      _mm256_mul_ps(_mm256_loadu_ps(x + 16 * k + 8), scale));
}

inline int64_t encode_block(const float* __restrict m, const float* __restrict v,
                            uint8_t* __restrict m_codes, uint8_t* __restrict v_codes,
                            float inv_m, float inv_v, int64_t n) {
  const __m256 scale_m = _mm256_set1_ps(inv_m), scale_v = _mm256_set1_ps(inv_v);
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF), sign8 = _mm256_set1_epi8(-128);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i m0 = scaled_top_halves16(m + i, scale_m, 0);
    const __m256i m1 = scaled_top_halves16(m + i, scale_m, 1);
    // signed saturation keeps each word's sign in its byte's bit 7
    const __m256i signs = _mm256_and_si256(_mm256_packs_epi16(m0, m1), sign8);
    const __m256i magnitudes =
        _mm256_packus_epi16(magnitude16(_mm256_and_si256(m0, abs16), kSignedOffset),
                            magnitude16(_mm256_and_si256(m1, abs16), kSignedOffset));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_codes + i),
                        ordered_codes32(_mm256_or_si256(magnitudes, signs)));
    // v >= +0 (a sum of products of non-negative values): no sign to clear
    const __m256i v0 = scaled_top_halves16(v + i, scale_v, 0);
    const __m256i v1 = scaled_top_halves16(v + i, scale_v, 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_codes + i),
                        ordered_codes32(_mm256_packus_epi16(magnitude16(v0, kUnsignedOffset),
                                                            magnitude16(v1, kUnsignedOffset))));
  }
  return i;
}

// The bf16 compute copy, 16 values a step, round to nearest even (to_bf16_bits). Written
// with streaming stores where 32-byte aligned: the copy is not read on this core again
// (the device copy reads it from memory), so it skips the read for ownership of each
// line (2 of the 4 bytes per parameter a cached store moves); the caller fences.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
}

inline int64_t write_bf16(const float* __restrict param, uint16_t* __restrict out, int64_t n) {
  const bool aligned = (reinterpret_cast<uintptr_t>(out) & 31) == 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> 64-bit quarters 0 2 1 3
    const __m256i words = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(bf16_bits8(_mm256_loadu_ps(param + i)),
                            bf16_bits8(_mm256_loadu_ps(param + i + 8))),
        0xD8);
    __m256i* target = reinterpret_cast<__m256i*>(out + i);
    if (aligned) {
      _mm256_stream_si256(target, words);
    } else {
      _mm256_storeu_si256(target, words);
    }
  }
  return i;
}

}  // namespace avx2
}  // namespace lazytrain_core
