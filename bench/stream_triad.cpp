// STREAM triad a = b + s * c over fp32 arrays, built by bench/optimizer.py (g++ -O3
// -march=native -fopenmp) and called through ctypes: the memory-bandwidth ceiling the
// optimizers are measured against. `nontemporal` writes `a` with streaming stores, which
// skip the read-for-ownership of a normal store: the triad then moves exactly the 12 bytes
// per element it counts, as the optimized STREAM builds do.
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" void triad(float* a, const float* b, const float* c, int64_t n, float s,
                      int threads, int nontemporal) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t chunk = 0; chunk < n / 4096; ++chunk) {
    const int64_t lo = chunk * 4096;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t i = lo; i < lo + 4096; i += 16) {
      const __m512 x = _mm512_add_ps(_mm512_loadu_ps(b + i),
                                     _mm512_mul_ps(sv, _mm512_loadu_ps(c + i)));
      if (nontemporal) _mm512_stream_ps(a + i, x); else _mm512_storeu_ps(a + i, x);
    }
#elif defined(__AVX__)
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t i = lo; i < lo + 4096; i += 8) {
      const __m256 x = _mm256_add_ps(_mm256_loadu_ps(b + i),
                                     _mm256_mul_ps(sv, _mm256_loadu_ps(c + i)));
      if (nontemporal) _mm256_stream_ps(a + i, x); else _mm256_storeu_ps(a + i, x);
    }
#else
    for (int64_t i = lo; i < lo + 4096; ++i) a[i] = b[i] + s * c[i];
#endif
  }
#if defined(__x86_64__)
  _mm_sfence();  // streaming stores are weakly ordered: done before the timer stops
#endif
}
