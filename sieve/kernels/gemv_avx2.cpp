// Decode-sized bf16 matrix products on CPUs with AVX2 + FMA and no AVX512-BF16: y [M, N] = x [M, K] .
// W [N, K]^T (+ bias) for M <= kGemvMaxRows, float32 accumulation. The same read pattern as gemv.cpp
// (each thread walks two halves of its rows, two read streams), with 8 weights at a time widened to
// float32 by a shift (bf16 is float32's top half) and FMAs against float32 inputs.
#include "kernels.h"

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace sieve {

namespace {

inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int64_t M, int R>
void dots(const float* x, const uint16_t* w, int64_t K, const int64_t (&n)[R], float* out) {
  __m256 acc[R][M];
  const uint16_t* rows[R];
  for (int j = 0; j < R; ++j) {
    rows[j] = w + n[j] * K;
    for (int64_t m = 0; m < M; ++m) acc[j][m] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k & 31) == 0)  // 384 bytes ahead in each stream
      for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + k + 192), _MM_HINT_T0);
    __m256 wv[R];
    for (int j = 0; j < R; ++j) wv[j] = load8(rows[j] + k);
    for (int64_t m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < R; ++j) acc[j][m] = _mm256_fmadd_ps(wv[j], xv, acc[j][m]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int64_t m = 0; m < M; ++m) {
      float s = hsum(acc[j][m]);
      for (int64_t t = k; t < K; ++t) s += static_cast<float>(c10::BFloat16(rows[j][t], c10::BFloat16::from_bits())) * x[m * K + t];
      out[j * M + m] = s;
    }
}

template <int64_t M>
void gemv(const float* x, const uint16_t* w, const bf16* bias, bf16* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    const int64_t half = (end - begin) / 2;
    float o[2 * M];
    auto store = [&](int64_t n, const float* v) {
      const float b = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = bf16(v[m] + b);
    };
    for (int64_t i = 0; i < half; ++i) {
      const int64_t n[2] = {begin + i, begin + half + i};
      dots<M, 2>(x, w, K, n, o);
      store(n[0], o);
      store(n[1], o + M);
    }
    if ((end - begin) % 2) {
      const int64_t n[1] = {end - 1};
      dots<M, 1>(x, w, K, n, o);
      store(end - 1, o);
    }
  });
}

}  // namespace

void gemv_bf16_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const bf16* bias, bf16* y) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  switch (M) {
    case 1: gemv<1>(xf.data(), wp, bias, y, K, N); break;
    case 2: gemv<2>(xf.data(), wp, bias, y, K, N); break;
    case 3: gemv<3>(xf.data(), wp, bias, y, K, N); break;
    default: gemv<4>(xf.data(), wp, bias, y, K, N); break;
  }
}

}  // namespace sieve

#endif
