// bf16 weights above the GEMV's rows on AVX512-BF16 CPUs whose vdpbf16ps is slow (`use_fma_dots`, qmatmul.cpp): a
// float32 FMA GEMM on panels of the weights widened to float32, as the AVX2 build's gemm_bf16_avx2_into does.
//
// Why: on the Emerald Rapids host one vdpbf16ps (32 products) holds a port for 2 cycles while float32 FMAs (16
// products) issue 2 a cycle, so FMAs multiply twice as fast; oneDNN's bf16 GEMM runs on vdpbf16ps there (96-182
// GFLOP/s on one SmolLM2 layer's matrices at 9-2048 rows, two cores, against 96-287 for these panels). A bf16
// model's serving steps with tens of sequences, and its prefills, are bound by these products.
//
// Tried first and not kept: the GEMV's own dot products (pairs of inputs along K, 16 lanes, reduced at the end) with
// each vdpbf16ps as its two FMAs, which would give every row the GEMV's bits at any batch. Each float32 x vector then
// serves only the two weight rows of a tile, so the x rows stream from L2 for every pair of weight rows: 72-121
// GFLOP/s, 0.50-0.80x oneDNN. The panel form broadcasts one input of a row against 32 outputs instead.
//
// The layout: for each block of 32 weight rows (outputs), a panel [K][32] float32 (a bf16 number widened is exact,
// by a 16-bit shift), built once per block and kept in the core's cache while tiles of up to 12 rows of x x 32
// outputs (24 accumulators) run over it; each output sums its K products in order in one float32 accumulator.
// Rows of x come kRowChunk at a time, so that a chunk's float32 rows stay in L2 while every panel passes over them.
// This is not the GEMV's summation order, so above 8 rows a row's result can differ in the last bit from the same
// row computed alone, as it did with oneDNN; `batch_invariant` keeps every batch on the GEMV.
#include "kernels.h"

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace sieve {

namespace {

constexpr int64_t kRowChunk = 128;  // rows of x per pass over the weights (float32: 128 x 1536 inputs = 768 KB)
constexpr int kTileRows = 12;

// 16 vectors -> their transpose (r[i] lane j -> r[j] lane i)
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[4q + s] now holds, per 128-bit block b, rows 4q..4q+3 of input 4b + s' (s' = 0, 1, 2, 3 for s = 0, 1, 2, 3)
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);       // blocks 0, 2 of r[i], then of r[4 + i]
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);   // blocks 1, 3
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);        // input i: rows 0-3, 4-7, 8-11, 12-15
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);    // input 8 + i
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

// Weight rows r0 .. r0 + 31 of a bf16 [N, K] matrix as a float32 panel [K][32] (rows past N: 0)
void make_panel(const uint16_t* w, int64_t N, int64_t K, int64_t r0, float* panel) {
  const int64_t rows = std::min<int64_t>(32, N - r0);
  for (int half = 0; half < 2; ++half) {
    const int64_t h0 = r0 + half * 16, hr = std::clamp<int64_t>(rows - half * 16, 0, 16);
    for (int64_t k = 0; k < K; k += 16) {
      const int64_t left = std::min<int64_t>(16, K - k);
      const __mmask16 mask = left == 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const __m256i v = i < hr ? _mm256_maskz_loadu_epi16(mask, w + (h0 + i) * K + k) : _mm256_setzero_si256();
        r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
      }
      transpose16(r);
      for (int j = 0; j < left; ++j) _mm512_store_ps(panel + (k + j) * 32 + half * 16, r[j]);
    }
  }
}

// rows m0 .. m0 + MR - 1 of x (float32 [*, K]) against a panel: y (bf16 [*, N]) columns n0 .. n0 + 31 (masked past N)
template <int MR>
void tile(const float* x, int64_t K, const float* panel, int64_t m0, int64_t n0, int64_t N, const float* bias, bf16* y) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_load_ps(panel + k * 32), w1 = _mm512_load_ps(panel + k * 32 + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(xr[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, xv, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xv, acc[m][1]);
    }
  }
  const int64_t cols = std::min<int64_t>(32, N - n0);
  const __mmask16 mk[2] = {cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1),
                           cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1)};
  __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias)
    for (int h = 0; h < 2; ++h) b[h] = _mm512_maskz_loadu_ps(mk[h], bias + n0 + 16 * h);
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h)
      _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0 + 16 * h, mk[h], (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][h], b[h])));
}

void rows_over_panel(const float* x, int64_t M, int64_t K, const float* panel, int64_t n0, int64_t N, const float* bias, bf16* y) {
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
    with_rows<kTileRows>(std::min<int64_t>(kTileRows, M - m0), [&]<int MR>() { tile<MR>(x, K, panel, m0, n0, N, bias, y); });
}

}  // namespace

void gemm_bf16_fma_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y) {
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  const int64_t panels = (N + 31) / 32;
  std::vector<float> xf(std::min(M, kRowChunk) * K);
  for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - c0);
    for (int64_t i = 0; i < mc * K; ++i) xf[i] = static_cast<float>(x[c0 * K + i]);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      float* panel = static_cast<float*>(std::aligned_alloc(64, ((K * 32 * sizeof(float) + 63) / 64) * 64));
      for (int64_t p = p0; p < p1; ++p) {
        make_panel(wp, N, K, p * 32, panel);
        rows_over_panel(xf.data(), mc, K, panel, p * 32, N, bias, y + c0 * N);
      }
      std::free(panel);
    });
  }
}

}  // namespace sieve

#endif
