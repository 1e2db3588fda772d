// A torch-free program around lazytrain_accel/optim/csrc/adamw8bit_core.h, so that the
// kernel's arithmetic is checked on CPUs the test machine is not: test_core_arm.py builds
// it for aarch64, runs it under qemu and compares its output with reference.py's bits.
//
// stdin: int64 n, int64 block_size, int64 grad_is_bf16, int64 write_bf16, 9 fp32 scalars
// (core's Scalars, in order), then master fp32[n], grad (fp32 or bf16 bits)[n], exp_avg
// codes uint8[n], exp_avg_sq codes uint8[n], exp_avg absmax fp32[blocks], exp_avg_sq absmax
// fp32[blocks]. stdout: the same five state arrays after one step, then the bf16 copy.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "adamw8bit_core.h"

using namespace lazytrain_core;

template <typename T>
std::vector<T> read_array(int64_t count) {
  std::vector<T> values(count);
  if (std::fread(values.data(), sizeof(T), count, stdin) != static_cast<size_t>(count)) {
    std::fprintf(stderr, "core_check: stdin ended before %lld values\n", (long long)count);
    std::exit(2);
  }
  return values;
}

template <typename T>
void write_array(const std::vector<T>& values) {
  std::fwrite(values.data(), sizeof(T), values.size(), stdout);
}

int main() {
  const std::vector<int64_t> header = read_array<int64_t>(4);
  const int64_t n = header[0], block_size = header[1];
  const int64_t blocks = (n + block_size - 1) / block_size;
  const std::vector<float> s = read_array<float>(9);
  const Scalars scalars{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]};
  std::vector<float> master = read_array<float>(n);
  const std::vector<float> grad_f32 = header[2] ? std::vector<float>() : read_array<float>(n);
  const std::vector<uint16_t> grad_bf16 =
      header[2] ? read_array<uint16_t>(n) : std::vector<uint16_t>();
  std::vector<uint8_t> m_codes = read_array<uint8_t>(n), v_codes = read_array<uint8_t>(n);
  std::vector<float> m_absmax = read_array<float>(blocks), v_absmax = read_array<float>(blocks);
  std::vector<uint16_t> out(header[3] ? n : 0);
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t start = k * block_size;
    const Block b{master.data() + start, m_codes.data() + start, v_codes.data() + start,
                  m_absmax.data() + k, v_absmax.data() + k,
                  header[3] ? out.data() + start : nullptr, std::min(block_size, n - start)};
    if (header[2]) {
      update_block(b, grad_bf16.data() + start, scalars);
    } else {
      update_block(b, grad_f32.data() + start, scalars);
    }
  }
  write_array(master);
  write_array(m_codes);
  write_array(v_codes);
  write_array(m_absmax);
  write_array(v_absmax);
  write_array(out);
  return 0;
}
