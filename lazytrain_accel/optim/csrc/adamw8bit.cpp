// Fused AdamW step with blockwise 8-bit float moments, on the CPU: the torch.library op.
//
// The arithmetic of one block lives in adamw8bit_core.h (torch-free, see there for the
// bit-exact contract); this file checks the tensors, spreads the blocks over ATen's
// OpenMP threads and registers the ops in the namespace LAZYTRAIN_OPS (native.py passes
// -DLAZYTRAIN_OPS=lazytrain_<variant>, so two variants' builds load in one process and a
// profiler trace names the variant): `adamw8bit_step` (its fake kernel is native.py's) and
// `kernel_info`. No pybind: torch.ops releases the GIL while the kernel runs. ATen's tensor
// and torch/library.h only, not <torch/extension.h> (the whole C++ frontend, 4x the
// compiler time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adamw8bit_core.h"

#ifndef LAZYTRAIN_OPS
#error "build with -DLAZYTRAIN_OPS=<op namespace> (native.py does)"
#endif
// expands LAZYTRAIN_OPS before TORCH_LIBRARY pastes it into its names
#define LAZYTRAIN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LAZYTRAIN_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

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

// (instruction set, the codes' constants for native.py to compare with codes.py, largest block)
std::tuple<std::string, std::vector<int64_t>, int64_t> kernel_info() {
  return {kInstructionSet,
          {kShift, kSignedOffset, kSignedMax, kUnsignedOffset, kUnsignedMax},
          kMaxBlock};
}

}  // namespace

LAZYTRAIN_LIBRARY(LAZYTRAIN_OPS, m) {
  // where the fake kernel (shapes for torch.compile and fake tensors) is registered
  m.set_python_module("lazytrain_accel.optim.native");
  // in place: the master, both moments' codes and absmax, and the bf16 copy when given
  m.def("adamw8bit_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg_codes, "
        "Tensor(c!) exp_avg_absmax, Tensor(d!) exp_avg_sq_codes, Tensor(e!) exp_avg_sq_absmax, "
        "Tensor(f!)? out_bf16, float beta1, float beta2, float eps, float decay, "
        "float step_size, float inv_bias_correction2_sqrt, float clip_coef, "
        "int block_size) -> ()");
  m.def("kernel_info() -> (str instruction_set, int[] code_constants, int max_block_size)",
        &kernel_info);
}

LAZYTRAIN_LIBRARY_IMPL(LAZYTRAIN_OPS, CPU, m) {
  m.impl("adamw8bit_step", &adamw8bit_step);
}
