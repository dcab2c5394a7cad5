// Decode-sized bf16 matrix products on CPU: y [M, N] = x [M, K] . W [N, K]^T (+ bias) for M <= kGemvMaxRows (8),
// float32 accumulation, bf16 output. (Quantized weights have their own kernel: qmatmul.cpp.)
//
// A decode step reads every weight once, so this is a read stream and everything else has to stay out
// of its way. Each thread takes a contiguous share of the N weight rows and walks two halves of it at
// once (two read streams: on some CPUs one stream per core cannot reach the memory bandwidth); 32
// weights at a time go into AVX512-BF16 dot products (vdpbf16ps), one float32 accumulator per (weight
// row, x row); the main loop has no branches and no masks (a masked step takes the tail of K).
// Measured on a Zen 5 core pair with the matrices of a 0.5B model: 21 ms per pass at one row, 46 GB/s,
// where a loop of the same arithmetic with a mask and a branch per step ran at 25 GB/s.
// Up to 8 rows of x against two weight rows: 16 float32 accumulators, summed by one transpose-and-add tree
// (hsum16). Each (weight row, x row) sum is the same sequence of dot products and the same reduction whatever the
// number of rows, so a row's result does not depend on the batch it came in (1 to 8 rows). oneDNN, which had every
// batch above 4 rows, read SmolLM2's 212 MB of layer weights in 7.0-7.7 ms at 5-8 rows where this takes 6.0-6.9;
// from ~11 rows on oneDNN's packed GEMM is the faster (vdpbf16ps at ~1 per cycle here in this dot-product form).
// The two-FMA form of the quantized tiles (qmatmul.cpp, `use_fma_dots`: the same bits) was tried here and not kept: on
// the Emerald Rapids host, where it makes a 4-row int4 step 29% cheaper, it made SmolLM2's bf16 step 5-17% dearer at
// 2-8 rows (splitting each weight vector's pairs costs two operations, and this loop is not bound by the dot products).
#include "kernels.h"

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace sieve {

namespace {

template <bool kTail>
inline __m512bh load32(const uint16_t* p, __mmask32 mask) {
  if constexpr (kTail) return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
  return (__m512bh)_mm512_loadu_si512(p);
}

// Dot products of R weight rows with the M rows of x, for 32 inputs starting at k.
template <int64_t M, int R, bool kTail>
inline void step(__m512 (&acc)[R][M], const uint16_t* x, int64_t K, const uint16_t* const (&rows)[R], int64_t k,
                 __mmask32 mask) {
  __m512bh w[R];
  if constexpr (!kTail)  // 384 bytes ahead in each read stream (rows of a stream are consecutive)
    for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + k + 192), _MM_HINT_T0);
  for (int j = 0; j < R; ++j) w[j] = load32<kTail>(rows[j] + k, mask);
  for (int64_t m = 0; m < M; ++m) {
    const __m512bh xv = load32<kTail>(x + m * K + k, mask);
    for (int j = 0; j < R; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], w[j], xv);
  }
}

// out[j * M + m] = W row j . x row m, for R <= 2 weight rows and M <= 8 x rows: the R * M sums reduced together
// by hsum16 (lanes beyond them zero), the same arithmetic for each sum whatever R and M are.
template <int64_t M, int R>
inline void dots(const uint16_t* x, const uint16_t* const (&rows)[R], int64_t K, float* out) {
  static_assert(R * M <= 16);
  __m512 acc[R][M];
  for (int j = 0; j < R; ++j)
    for (int64_t m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step<M, R, false>(acc, x, K, rows, k, 0);
  if (k < K) step<M, R, true>(acc, x, K, rows, k, (__mmask32(1) << (K - k)) - 1);
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = i < R * M ? acc[i / M][i % M] : _mm512_setzero_ps();
  _mm512_storeu_ps(out, hsum16(v));
}

template <int R>
inline void dots_any(const uint16_t* x, int64_t mc, const uint16_t* const (&rows)[R], int64_t K, float* out) {
  switch (mc) {
    case 1: return dots<1, R>(x, rows, K, out);
    case 2: return dots<2, R>(x, rows, K, out);
    case 3: return dots<3, R>(x, rows, K, out);
    case 4: return dots<4, R>(x, rows, K, out);
    case 5: return dots<5, R>(x, rows, K, out);
    case 6: return dots<6, R>(x, rows, K, out);
    case 7: return dots<7, R>(x, rows, K, out);
    default: return dots<8, R>(x, rows, K, out);
  }
}

void gemv(const uint16_t* x, int64_t M, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    const int64_t half = (end - begin) / 2;
    alignas(64) float o[16];
    auto store = [&](int64_t n, const float* v) {
      const float b = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = c10::BFloat16(v[m] + b);
    };
    for (int64_t i = 0; i < half; ++i) {
      const uint16_t* const rows[2] = {w + (begin + i) * K, w + (begin + half + i) * K};
      dots_any<2>(x, M, rows, K, o);
      store(begin + i, o);
      store(begin + half + i, o + M);
    }
    if ((end - begin) % 2) {
      const uint16_t* const rows[1] = {w + (end - 1) * K};
      dots_any<1>(x, M, rows, K, o);
      store(end - 1, o);
    }
  });
}

}  // namespace

void gemv_bf16_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const bf16* bias, bf16* y) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  TORCH_CHECK(M >= 1 && M <= kGemvMaxRows, "gemv_bf16_into takes 1 to ", kGemvMaxRows, " rows");
  gemv(xp, M, wp, bias, y, K, N);
}

}  // namespace sieve

#endif
