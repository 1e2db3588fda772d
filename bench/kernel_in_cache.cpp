// One thread's cost of the 8-bit kernel's block update with everything in L2: 256 blocks
// of 256 parameters (about 0.7 MiB of master, gradient and codes), the state reset before
// each sweep, best of 3000 sweeps. Built by bench/kernel_in_cache.py once per kernel
// variant's flags; prints nanoseconds per parameter.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "adamw8bit_core.h"

using namespace lazytrain_core;

int main() {
  const int64_t block = 256, blocks = 256, n = block * blocks;
  std::vector<float> param(n), grad(n), m_absmax(blocks), v_absmax(blocks);
  std::vector<uint8_t> m_codes0(n), v_codes0(n), m_codes(n), v_codes(n);
  for (int64_t i = 0; i < n; ++i) {
    grad[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-6f - 5e-4f;
    m_codes0[i] = static_cast<uint8_t>(i * 7);
    v_codes0[i] = static_cast<uint8_t>(i * 13);
  }
  const Scalars s{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.99999f, 1e-5f, 1.2f, 1.0f};
  double best_s = 1e9;
  for (int sweep = 0; sweep < 3000; ++sweep) {
    m_codes = m_codes0;
    v_codes = v_codes0;
    std::fill(m_absmax.begin(), m_absmax.end(), 1e-3f);
    std::fill(v_absmax.begin(), v_absmax.end(), 1e-6f);
    std::fill(param.begin(), param.end(), 0.01f);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t first = k * block;
      const Block b{param.data() + first, m_codes.data() + first, v_codes.data() + first,
                    m_absmax.data() + k, v_absmax.data() + k, nullptr, block};
      update_block(b, grad.data() + first, s);
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best_s = std::min(best_s, took.count());
  }
  std::printf("%.3f\n", best_s / static_cast<double>(n) * 1e9);
  return 0;
}
