// Fused AdamW step with blockwise 8-bit float moments, on the CPU: the torch binding.
//
// The arithmetic of one block lives in adamw8bit_core.h (torch-free, see there for the
// bit-exact contract); this file checks the tensors and spreads the blocks over ATen's
// OpenMP threads. native.py compiles it once per instruction-set variant (AVX2, AVX-512,
// ...) and loads the one this CPU supports.
// ATen's tensor and the pybind casters only, not <torch/extension.h> (the whole C++
// frontend): a build takes a quarter of the compiler time (9 s instead of 40 s a variant).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>

#include "adamw8bit_core.h"

namespace {

using namespace lazytrain_core;

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
    if (out != nullptr) fence_streaming_stores();
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw8bit_step", &adamw8bit_step, py::call_guard<py::gil_scoped_release>(),
        "Fused AdamW step with blockwise 8-bit moments (in place).");
  m.attr("code_constants") =
      py::make_tuple(kShift, kSignedOffset, kSignedMax, kUnsignedOffset, kUnsignedMax);
  m.attr("max_block_size") = kMaxBlock;
  m.attr("instruction_set") = kInstructionSet;
}
