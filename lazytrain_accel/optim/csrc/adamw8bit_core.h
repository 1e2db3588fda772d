// The arithmetic of the fused 8-bit AdamW step on one block, free of torch and of any
// threading, so that adamw8bit.cpp (the torch extension) and a plain C++ test program (built
// for aarch64 and run under qemu by tests/optim/test_core_arm.py) compile the same lines.
//
// Bit-exact contract: lazytrain_accel/optim/reference.py and codes.py compute the same
// values with the same fp32 operations in the same order. Build flags keep that true:
// -ffp-contract=off (no fused multiply-add), -fno-math-errno (sqrt vectorizes, still IEEE).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace lazytrain_core {

// The instruction set this translation unit was compiled for (native.py's variant names):
// the tests check that each variant's build really is what its flags promise.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr const char* kInstructionSet = "avx512";
#elif defined(__AVX2__)
constexpr const char* kInstructionSet = "avx2";
#elif defined(__ARM_NEON)
constexpr const char* kInstructionSet = "neon";
#else
constexpr const char* kInstructionSet = "portable";
#endif

constexpr int64_t kMaxBlock = 4096;
// Codes: see codes.py. Signed e4m3 for exp_avg, unsigned e5m3 for exp_avg_sq.
constexpr int kShift = 20;               // 23 - 3 mantissa bits
constexpr uint32_t kHalf = 1u << (kShift - 1);
constexpr int32_t kSignedOffset = 889;   // (0x3F800000 >> 20) - 127
constexpr int32_t kSignedMax = 127;
constexpr int32_t kUnsignedOffset = 761; // (0x3F800000 >> 20) - 255
constexpr int32_t kUnsignedMax = 255;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Finite inputs are <= 1 (+ one ulp, from multiplying by the rounded reciprocal of the
// absmax), which rounds to the largest code: no upper clamp is needed, and dropping it
// (with a canonical-zero select in encode_signed) cut the in-cache cost by ~15%. NaN/inf
// may encode differently from codes.py; they reach the kernel only when no norm check ran
// (no clipping, no engine norms), and then the moments are lost either way.
inline int32_t rounded_magnitude(uint32_t u, int32_t offset) {
  constexpr int32_t kRounding = static_cast<int32_t>(kHalf);
  const int32_t c = (static_cast<int32_t>(u & 0x7FFFFFFFu) + (kRounding - (offset << kShift))) >>
                    kShift;
  return c > 0 ? c : 0;
}

inline uint8_t encode_signed(float y) {
  // a magnitude rounded to 0 keeps its sign bit ("-0", 0x80): it decodes to 0 all the same
  const uint32_t u = bits_of(y);
  const int32_t sign = static_cast<int32_t>((u >> 24) & 0x80u);
  return static_cast<uint8_t>(rounded_magnitude(u, kSignedOffset) | sign);
}

inline uint8_t encode_unsigned(float y) {
  return static_cast<uint8_t>(rounded_magnitude(bits_of(y), kUnsignedOffset));
}

inline float decode_signed(uint8_t c) {
  uint32_t magnitude = c & 0x7Fu;
  uint32_t u = ((magnitude + kSignedOffset) << kShift) | ((c & 0x80u) << 24);
  return magnitude == 0 ? 0.0f : float_of(u);
}

inline float decode_unsigned(uint8_t c) {
  return c == 0 ? 0.0f : float_of((static_cast<uint32_t>(c) + kUnsignedOffset) << kShift);
}

inline float load_grad(const float* g, int64_t i) { return g[i]; }

inline float load_grad(const uint16_t* g, int64_t i) {
  return float_of(static_cast<uint32_t>(g[i]) << 16);
}

inline uint16_t to_bf16_bits(float x) {
  // round to nearest even, as c10::BFloat16 does for finite values
  uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Scalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size,
      inv_bias_correction2_sqrt, clip_coef;
};

}  // namespace lazytrain_core

// The AVX2 build runs hand-vectorized loops (adamw8bit_avx2.h says why); the AVX-512 build
// keeps the compiler's vectorization of the portable loops, which its mask registers and
// 32 vector registers make good (docs/optimizer.md "Kernel variants").
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(LAZYTRAIN_PORTABLE_LOOPS_ONLY)
#define LAZYTRAIN_EXPLICIT_AVX2 1
#include "adamw8bit_avx2.h"
#endif

namespace lazytrain_core {

struct Block {
  float* param;
  uint8_t* exp_avg_codes;
  uint8_t* exp_avg_sq_codes;
  float* exp_avg_absmax;
  float* exp_avg_sq_absmax;
  uint16_t* out_bf16;  // nullptr: no compute copy
  int64_t n;
};

// New moments of one block into m/v (local buffers) and the updated master; returns the
// blocks' new absmax through max_m/max_v. __restrict lets the compiler vectorize.
template <typename grad_t>
inline void update_moments(float* __restrict param, const grad_t* __restrict grad,
                    const uint8_t* __restrict m_codes, const uint8_t* __restrict v_codes,
                    float absmax_m, float absmax_v, float* __restrict m_out,
                    float* __restrict v_out, int64_t n, const Scalars& s, float& max_m_out,
                    float& max_v_out) {
  const Scalars c = s;  // a local copy: loop-invariant scalars in registers
  float max_m = 0.0f, max_v = 0.0f;
  int64_t first = 0;
#ifdef LAZYTRAIN_EXPLICIT_AVX2
  first = c.clip_coef != 1.0f
              ? avx2::update_moments<true>(param, grad, m_codes, v_codes, absmax_m, absmax_v,
                                           m_out, v_out, n, c, max_m, max_v)
              : avx2::update_moments<false>(param, grad, m_codes, v_codes, absmax_m, absmax_v,
                                            m_out, v_out, n, c, max_m, max_v);
#endif
#pragma omp simd reduction(max : max_m, max_v)
  for (int64_t i = first; i < n; ++i) {
    const float g = load_grad(grad, i) * c.clip_coef;  // x * 1.0f == x: no branch needed
    const float m = decode_signed(m_codes[i]) * absmax_m * c.beta1 + g * c.one_minus_beta1;
    const float v = decode_unsigned(v_codes[i]) * absmax_v * c.beta2 + g * g * c.one_minus_beta2;
    m_out[i] = m;
    v_out[i] = v;
    max_m = std::max(max_m, std::fabs(m));
    max_v = std::max(max_v, v);
    const float denom = std::sqrt(v) * c.inv_bias_correction2_sqrt + c.eps;
    const float update = m / denom * c.step_size;
    param[i] = param[i] * c.decay - update;
  }
  max_m_out = max_m;
  max_v_out = max_v;
}

inline void encode_block(const float* __restrict m, const float* __restrict v,
                  uint8_t* __restrict m_codes, uint8_t* __restrict v_codes, float max_m,
                  float max_v, int64_t n) {
  const float inv_m = max_m > 0.0f ? 1.0f / max_m : 0.0f;
  const float inv_v = max_v > 0.0f ? 1.0f / max_v : 0.0f;
  int64_t first = 0;
#ifdef LAZYTRAIN_EXPLICIT_AVX2
  first = avx2::encode_block(m, v, m_codes, v_codes, inv_m, inv_v, n);
#endif
#pragma omp simd
  for (int64_t i = first; i < n; ++i) {
    m_codes[i] = encode_signed(m[i] * inv_m);
    v_codes[i] = encode_unsigned(v[i] * inv_v);
  }
}

inline void write_bf16(const float* __restrict param, uint16_t* __restrict out, int64_t n) {
  int64_t first = 0;
#ifdef LAZYTRAIN_EXPLICIT_AVX2
  first = avx2::write_bf16(param, out, n);
#endif
#pragma omp simd
  for (int64_t i = first; i < n; ++i) out[i] = to_bf16_bits(param[i]);
}

// Orders this thread's streaming stores (write_bf16) before whatever it does next: the
// threads' work is joined after this, and the copy read.
inline void fence_streaming_stores() {
#ifdef LAZYTRAIN_EXPLICIT_AVX2
  _mm_sfence();
#endif
}

template <typename grad_t>
inline void update_block(const Block& b, const grad_t* grad, const Scalars& s) {
  alignas(64) float exp_avg[kMaxBlock];
  alignas(64) float exp_avg_sq[kMaxBlock];
  float max_m = 0.0f, max_v = 0.0f;
  update_moments(b.param, grad, b.exp_avg_codes, b.exp_avg_sq_codes, *b.exp_avg_absmax,
                 *b.exp_avg_sq_absmax, exp_avg, exp_avg_sq, b.n, s, max_m, max_v);
  encode_block(exp_avg, exp_avg_sq, b.exp_avg_codes, b.exp_avg_sq_codes, max_m, max_v, b.n);
  *b.exp_avg_absmax = max_m;
  *b.exp_avg_sq_absmax = max_v;
  if (b.out_bf16 != nullptr) write_bf16(b.param, b.out_bf16, b.n);
}

}  // namespace lazytrain_core
