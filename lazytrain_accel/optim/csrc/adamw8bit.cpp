// Fused AdamW step with blockwise 8-bit float moments, on the CPU.
//
// One pass over memory per element: read the gradient (fp32 or bf16), read/write the fp32
// master, read/write the two uint8 codes, optionally write the bf16 compute copy. A block
// (<= 4096 elements) is updated in registers/L1: its new moments are kept in two small
// stack buffers until its absmax is known, then quantized. Blocks are spread over ATen's
// OpenMP threads.
//
// Bit-exact contract: lazytrain_accel/optim/reference.py and codes.py compute the same
// values with the same fp32 operations in the same order. Build flags keep that true:
// -ffp-contract=off (no fused multiply-add), -fno-math-errno (sqrt vectorizes, still IEEE).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

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
void update_moments(float* __restrict param, const grad_t* __restrict grad,
                    const uint8_t* __restrict m_codes, const uint8_t* __restrict v_codes,
                    float absmax_m, float absmax_v, float* __restrict m_out,
                    float* __restrict v_out, int64_t n, const Scalars& s, float& max_m_out,
                    float& max_v_out) {
  const Scalars c = s;  // a local copy: loop-invariant scalars in registers
  float max_m = 0.0f, max_v = 0.0f;
#pragma omp simd reduction(max : max_m, max_v)
  for (int64_t i = 0; i < n; ++i) {
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

void encode_block(const float* __restrict m, const float* __restrict v,
                  uint8_t* __restrict m_codes, uint8_t* __restrict v_codes, float max_m,
                  float max_v, int64_t n) {
  const float inv_m = max_m > 0.0f ? 1.0f / max_m : 0.0f;
  const float inv_v = max_v > 0.0f ? 1.0f / max_v : 0.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    m_codes[i] = encode_signed(m[i] * inv_m);
    v_codes[i] = encode_unsigned(v[i] * inv_v);
  }
}

void write_bf16(const float* __restrict param, uint16_t* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16_bits(param[i]);
}

template <typename grad_t>
void update_block(const Block& b, const grad_t* grad, const Scalars& s) {
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

void check_inputs(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m_codes,
                  const at::Tensor& m_absmax, const at::Tensor& v_codes,
                  const at::Tensor& v_absmax, int64_t block_size) {
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxBlock, "block_size=", block_size,
              " must be in [1, ", kMaxBlock, "]");
  TORCH_CHECK(param.device().is_cpu() && param.scalar_type() == at::kFloat &&
                  param.is_contiguous(),
              "the master weight must be a contiguous fp32 CPU tensor, got ", param.options());
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "the gradient must be a contiguous fp32 or bf16 CPU tensor, got ", grad.options());
  const int64_t n = param.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  TORCH_CHECK(grad.numel() == n && m_codes.numel() == n && v_codes.numel() == n,
              "gradient/codes sizes differ from the master's ", n, " elements");
  TORCH_CHECK(m_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte &&
                  m_codes.is_contiguous() && v_codes.is_contiguous(),
              "codes must be contiguous uint8 tensors");
  TORCH_CHECK(m_absmax.numel() == blocks && v_absmax.numel() == blocks &&
                  m_absmax.scalar_type() == at::kFloat && v_absmax.scalar_type() == at::kFloat,
              "absmax must be fp32 with one value per block (", blocks, ")");
}

void adamw8bit_step(at::Tensor param, at::Tensor grad, at::Tensor m_codes, at::Tensor m_absmax,
                    at::Tensor v_codes, at::Tensor v_absmax, std::optional<at::Tensor> out_bf16,
                    double beta1, double beta2, double eps, double decay, double step_size,
                    double inv_bias_correction2_sqrt, double clip_coef, int64_t block_size) {
  check_inputs(param, grad, m_codes, m_absmax, v_codes, v_absmax, block_size);
  uint16_t* out = nullptr;
  if (out_bf16.has_value()) {
    TORCH_CHECK(out_bf16->scalar_type() == at::kBFloat16 && out_bf16->is_contiguous() &&
                    out_bf16->numel() == param.numel() && out_bf16->device().is_cpu(),
                "out_bf16 must be a contiguous bf16 CPU tensor shaped like the master");
    out = reinterpret_cast<uint16_t*>(out_bf16->data_ptr());
  }
  // doubles -> float exactly as torch casts a Python scalar for an fp32 op
  const Scalars s{static_cast<float>(beta1), static_cast<float>(1.0 - beta1),
                  static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
                  static_cast<float>(eps), static_cast<float>(decay),
                  static_cast<float>(step_size), static_cast<float>(inv_bias_correction2_sqrt),
                  static_cast<float>(clip_coef)};
  const int64_t n = param.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  float* p = param.data_ptr<float>();
  uint8_t* mc = m_codes.data_ptr<uint8_t>();
  uint8_t* vc = v_codes.data_ptr<uint8_t>();
  float* ma = m_absmax.data_ptr<float>();
  float* va = v_absmax.data_ptr<float>();
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  const int64_t grain_blocks = std::max<int64_t>(1, 32768 / block_size);
  at::parallel_for(0, blocks, grain_blocks, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const int64_t start = k * block_size;
      const Block b{p + start, mc + start, vc + start, ma + k, va + k,
                    out == nullptr ? nullptr : out + start, std::min(block_size, n - start)};
      if (bf16_grad) {
        update_block(b, static_cast<const uint16_t*>(g) + start, s);
      } else {
        update_block(b, static_cast<const float*>(g) + start, s);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw8bit_step", &adamw8bit_step, py::call_guard<py::gil_scoped_release>(),
        "Fused AdamW step with blockwise 8-bit moments (in place).");
  m.attr("code_constants") =
      py::make_tuple(kShift, kSignedOffset, kSignedMax, kUnsignedOffset, kUnsignedMax);
  m.attr("max_block_size") = kMaxBlock;
}
