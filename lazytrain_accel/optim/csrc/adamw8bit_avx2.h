// The block update's two loops written with AVX2 intrinsics, 8 lanes of 32 bits at a time.
// Included by adamw8bit_core.h in the AVX2 build only. The compiler's own vectorization of
// the portable loops works on 32 uint8 codes at once: it widens bytes to words to dwords
// with extract/zero-extend pairs, widens the byte-wide zero masks the same way, and runs
// out of the 16 ymm registers (spills in the inner loop); here each 8-code load is one
// vpmovzxbd, the zero test a dword compare, and 4 x 8 codes are packed back in 3 ops.
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

inline __m256i load_codes8(const uint8_t* c) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}

inline __m256 decode_signed8(__m256i c) {
  const __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i u = _mm256_or_si256(
      _mm256_slli_epi32(_mm256_add_epi32(magnitude, _mm256_set1_epi32(kSignedOffset)), kShift),
      sign);
  const __m256i zero = _mm256_cmpeq_epi32(magnitude, _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_andnot_si256(zero, u));  // +0.0f where magnitude is 0
}

inline __m256 decode_unsigned8(__m256i c) {
  const __m256i u = _mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(kUnsignedOffset)),
                                      kShift);
  const __m256i zero = _mm256_cmpeq_epi32(c, _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_andnot_si256(zero, u));
}

inline float horizontal_max(__m256 x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float result = lanes[0];
  for (int k = 1; k < 8; ++k) result = std::max(result, lanes[k]);
  return result;
}

template <typename grad_t>
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
    const __m256 g = _mm256_mul_ps(load_grad8(grad + i), clip);
    const __m256 m = _mm256_add_ps(
        _mm256_mul_ps(_mm256_mul_ps(decode_signed8(load_codes8(m_codes + i)), am), b1),
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

inline __m256i rounded_magnitude8(__m256i u, int32_t offset) {
  const __m256i biased = _mm256_add_epi32(
      _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
      _mm256_set1_epi32(static_cast<int32_t>(kHalf) - (offset << kShift)));
  return _mm256_max_epi32(_mm256_srai_epi32(biased, kShift), _mm256_setzero_si256());
}

inline __m256i encode_signed8(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  return _mm256_or_si256(rounded_magnitude8(u, kSignedOffset), sign);
}

inline __m256i encode_unsigned8(__m256 y) {
  return rounded_magnitude8(_mm256_castps_si256(y), kUnsignedOffset);
}

// Four vectors of 8 codes (each 0..255 in a dword) -> 32 bytes in order: the packs work
// within 128-bit lanes, the permute puts the dword groups back in sequence.
inline __m256i pack_codes32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline int64_t encode_block(const float* __restrict m, const float* __restrict v,
                            uint8_t* __restrict m_codes, uint8_t* __restrict v_codes,
                            float inv_m, float inv_v, int64_t n) {
  const __m256 scale_m = _mm256_set1_ps(inv_m), scale_v = _mm256_set1_ps(inv_v);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i cm[4], cv[4];
    for (int k = 0; k < 4; ++k) {
      cm[k] = encode_signed8(_mm256_mul_ps(_mm256_loadu_ps(m + i + 8 * k), scale_m));
      cv[k] = encode_unsigned8(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * k), scale_v));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_codes + i),
                        pack_codes32(cm[0], cm[1], cm[2], cm[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_codes + i),
                        pack_codes32(cv[0], cv[1], cv[2], cv[3]));
  }
  return i;
}

}  // namespace avx2
}  // namespace lazytrain_core
