// Matrix products with quantized weights on CPUs with AVX2 + FMA + F16C and no AVX512-BF16 (most
// laptops and desktops, older servers): the same weights in the same blocked layouts as qmatmul.cpp
// (sieve/quant/kernels.py makes them), with no bf16 dot product to lean on. Built when the CPU (or
// SIEVE_CPU_ISA=avx2) has no AVX512-BF16; see sieve/kernels/__init__.py.
//
// The weights are decoded to float32, exactly, and multiplied by float32 inputs with FMAs:
//   int8  sign-extend, convert                             w = q            (row scale at the store)
//   fp8   e4m3 bits moved into float32's (no subnormal codes; quantize_fp8 writes none), times 2^120
//   Q8_0  int8 times its group's float16 scale             w = q * s        (exact: 8 x 11 bits)
//   int4  the nibbles of a unit, zero-extended             w = q * s + m    (Q4_0: (q - 8) * s), one FMA,
//         which rounds once, as gguf's d * q + m does (d * q is exact)
// A 32-byte pair-vector (16 rows x 2 inputs, bytes interleaved per row) splits with one byte shuffle
// into rows 0-7 and 8-15 of each input.
//
// Each output sums its products over the inputs in order, in one float32 accumulator, whatever the
// batch, so that a row's result does not depend on how many rows share the call:
//   - 1 row (decode): weights decoded on the fly, three blocks of 16 outputs walked side by side (three
//     read streams per thread; six accumulators hide the FMA latency);
//   - more rows: a block's weights decoded once into a float32 panel [K, 16] that stays in the core's
//     cache, then tiles of up to 6 rows x 16 outputs run FMAs from it, so that no matrix is widened
//     whole and each decoded weight serves every row.
#include "kernels.h"

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sieve {

namespace {

constexpr int64_t kPrefetch = 384;  // bytes ahead in each weight stream

inline __m256 cvt_s8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }  // low 8 bytes, signed
inline __m256 cvt_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }  // low 8 bytes, unsigned
inline __m256 cvt_fp8(__m128i v) {  // low 8 e4m3 codes -> float32 bits (times 2^-120), then times 2^120
  const __m256i u = _mm256_cvtepu8_epi32(v);
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), 20),
                                       _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

// 32 bytes, two per row for 16 rows -> per 128-bit lane (8 rows): the 8 first bytes, then the 8 second
inline void split_pairs(__m256i b, __m128i& rows0, __m128i& rows8) {
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9,
                                         11, 13, 15);
  const __m256i s = _mm256_shuffle_epi8(b, order);
  rows0 = _mm256_castsi256_si128(s);
  rows8 = _mm256_extracti128_si256(s, 1);
}

enum class Code { kInt8, kFp8, kInt4 };

// What one call needs to decode its blocks: the codes and, per group, float16 scales / mins.
struct Weights {
  const uint8_t* w;        // blocked codes
  int64_t K2;              // padded inputs
  Code code;
  const c10::Half* scale;  // [NBlocks, G, 16] float16 (Q8_0, int4), or null (int8 / fp8 with row scales)
  const c10::Half* min;    // int4: [NBlocks, G, 16] or null (w = (q - 8) s)
  int64_t group;           // inputs per scale (0: none)
  int64_t block_bytes() const { return code == Code::kInt4 ? K2 / 4 * 32 : K2 / 2 * 32; }
};

// The float32 weights of inputs k0 = 2p, 2p + 1 (one pair-vector) of block `blk`: w[0] rows 0-7 @ k0,
// w[1] rows 0-7 @ k0 + 1, w[2] rows 8-15 @ k0, w[3] rows 8-15 @ k0 + 1.
struct PairDecoder {
  const Weights* Wp = nullptr;
  const uint8_t* base = nullptr;
  int64_t blk = 0, G = 0;
  __m256 s0, s1, m0, m1;  // the current group's scale (and min) for rows 0-7 and 8-15
  int64_t group_at = -1;

  void init(const Weights& weights, int64_t block) {
    Wp = &weights, blk = block, base = weights.w + block * weights.block_bytes(), G = weights.group ? weights.K2 / weights.group : 0;
    group_at = -1;
  }

  void load_group(int64_t k) {
    const Weights& W = *Wp;
    const int64_t g = k / W.group;
    if (g == group_at) return;
    group_at = g;
    const c10::Half* sp = W.scale + (blk * G + g) * 16;
    s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 8)));
    if (W.code == Code::kInt4) {
      if (W.min) {
        const c10::Half* mp = W.min + (blk * G + g) * 16;
        m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp)));
        m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + 8)));
      } else {
        m0 = _mm256_mul_ps(s0, _mm256_set1_ps(-8.f));
        m1 = _mm256_mul_ps(s1, _mm256_set1_ps(-8.f));
      }
    }
  }

  // pair-vector p of a one-byte format, or pair-vector 2u + hi of int4 unit u
  void decode(int64_t k0, __m256 (&w)[4]) {
    const Weights& W = *Wp;
    __m128i r0, r8;
    if (W.code == Code::kInt4) {
      const int64_t u = k0 / 4, hi = (k0 / 2) & 1;
      if (!hi && (u & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(base + u * 32 + kPrefetch), _MM_HINT_T0);
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + u * 32));
      if (hi) b = _mm256_srli_epi16(b, 4);
      split_pairs(_mm256_and_si256(b, _mm256_set1_epi8(0x0F)), r0, r8);
      load_group(k0);
      w[0] = _mm256_fmadd_ps(cvt_u8(r0), s0, m0);
      w[1] = _mm256_fmadd_ps(cvt_u8(_mm_srli_si128(r0, 8)), s0, m0);
      w[2] = _mm256_fmadd_ps(cvt_u8(r8), s1, m1);
      w[3] = _mm256_fmadd_ps(cvt_u8(_mm_srli_si128(r8, 8)), s1, m1);
      return;
    }
    const int64_t p = k0 / 2;
    if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(base + p * 32 + kPrefetch), _MM_HINT_T0);
    split_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + p * 32)), r0, r8);
    if (W.code == Code::kFp8) {
      w[0] = cvt_fp8(r0), w[1] = cvt_fp8(_mm_srli_si128(r0, 8)), w[2] = cvt_fp8(r8), w[3] = cvt_fp8(_mm_srli_si128(r8, 8));
      return;
    }
    w[0] = cvt_s8(r0), w[1] = cvt_s8(_mm_srli_si128(r0, 8)), w[2] = cvt_s8(r8), w[3] = cvt_s8(_mm_srli_si128(r8, 8));
    if (W.scale) {  // Q8_0: q * s, exact
      load_group(k0);
      w[0] = _mm256_mul_ps(w[0], s0), w[1] = _mm256_mul_ps(w[1], s0), w[2] = _mm256_mul_ps(w[2], s1), w[3] = _mm256_mul_ps(w[3], s1);
    }
  }
};

struct Out {  // y = acc * row_scale * post + bias, as bf16 or float32
  void* y;
  bool f32;
  int64_t N;
  const float* row_scale;
  const float* bias;
  float post;

  void store(const __m256 (&acc)[2], int64_t m, int64_t blk) const {
    const int64_t n0 = blk * 16;
    alignas(32) float v[16];
    _mm256_store_ps(v, acc[0]);
    _mm256_store_ps(v + 8, acc[1]);
    const int64_t cnt = std::min<int64_t>(16, N - n0);
    for (int64_t i = 0; i < cnt; ++i) {
      float r = v[i] * (row_scale ? row_scale[n0 + i] * post : post) + (bias ? bias[n0 + i] : 0.f);
      if (f32) static_cast<float*>(y)[m * N + n0 + i] = r;
      else static_cast<c10::BFloat16*>(y)[m * N + n0 + i] = c10::BFloat16(r);
    }
  }
};

// One row of x against NB blocks, weights decoded on the fly
template <int NB>
void row_tile(const float* x, const Weights& W, const int64_t (&blk)[NB], int64_t m, const Out& out) {
  __m256 acc[NB][2];
  PairDecoder dec[NB];
  for (int b = 0; b < NB; ++b) {
    acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    dec[b].init(W, blk[b]);
  }
  for (int64_t k = 0; k < W.K2; k += 2) {
    const __m256 x0 = _mm256_set1_ps(x[k]), x1 = _mm256_set1_ps(x[k + 1]);
    for (int b = 0; b < NB; ++b) {
      __m256 w[4];
      dec[b].decode(k, w);
      acc[b][0] = _mm256_fmadd_ps(w[1], x1, _mm256_fmadd_ps(w[0], x0, acc[b][0]));
      acc[b][1] = _mm256_fmadd_ps(w[3], x1, _mm256_fmadd_ps(w[2], x0, acc[b][1]));
    }
  }
  for (int b = 0; b < NB; ++b) out.store(acc[b], m, blk[b]);
}

// One block against all rows of x: the block decoded once into a float32 panel [K2][16]
template <int MR>
void panel_rows(const float* x, int64_t K2, const float* panel, int64_t m0, int64_t blk, const Out& out) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * 16), w1 = _mm256_load_ps(panel + k * 16 + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_set1_ps(x[(m0 + m) * K2 + k]);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) out.store(acc[m], m0 + m, blk);
}

void run(const float* x, int64_t M, const Weights& W, int64_t blocks, const Out& out) {
  if (M == 1) {
    constexpr int NB = 3;
    at::parallel_for(0, blocks, NB, [&](int64_t b0, int64_t b1) {
      const int64_t part = (b1 - b0) / NB;  // NB consecutive runs of blocks, walked side by side
      for (int64_t i = 0; i < part; ++i) {
        int64_t blk[NB];
        for (int j = 0; j < NB; ++j) blk[j] = b0 + j * part + i;
        row_tile<NB>(x, W, blk, 0, out);
      }
      for (int64_t b = b0 + NB * part; b < b1; ++b) {
        const int64_t one[1] = {b};
        row_tile<1>(x, W, one, 0, out);
      }
    });
    return;
  }
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    float* panel = static_cast<float*>(std::aligned_alloc(32, W.K2 * 16 * sizeof(float)));
    for (int64_t b = b0; b < b1; ++b) {
      PairDecoder dec;
      dec.init(W, b);
      for (int64_t k = 0; k < W.K2; k += 2) {
        __m256 w[4];
        dec.decode(k, w);
        _mm256_store_ps(panel + k * 16, w[0]);
        _mm256_store_ps(panel + k * 16 + 8, w[2]);
        _mm256_store_ps(panel + (k + 1) * 16, w[1]);
        _mm256_store_ps(panel + (k + 1) * 16 + 8, w[3]);
      }
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        switch (std::min<int64_t>(6, M - m0)) {
          case 6: panel_rows<6>(x, W.K2, panel, m0, b, out); break;
          case 5: panel_rows<5>(x, W.K2, panel, m0, b, out); break;
          case 4: panel_rows<4>(x, W.K2, panel, m0, b, out); break;
          case 3: panel_rows<3>(x, W.K2, panel, m0, b, out); break;
          case 2: panel_rows<2>(x, W.K2, panel, m0, b, out); break;
          default: panel_rows<1>(x, W.K2, panel, m0, b, out); break;
        }
      }
    }
    std::free(panel);
  });
}

// x [M, K] (bf16 or float32) as float32 [M, K2] with zero padding inputs
std::vector<float> float_input(const void* x, bool f32, int64_t M, int64_t K, int64_t K2) {
  std::vector<float> out(M * K2, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      out[m * K2 + k] = f32 ? static_cast<const float*>(x)[m * K + k] : static_cast<float>(static_cast<const c10::BFloat16*>(x)[m * K + k]);
  return out;
}

}  // namespace

void qmatmul_q8_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2, bool fp8,
                     const float* row_scale, const c10::Half* gscale, int64_t group, const float* bias, int64_t n, void* y) {
  const auto xf = float_input(x, f32, M, K, K2);
  const Weights W{w, K2, fp8 ? Code::kFp8 : Code::kInt8, gscale, nullptr, gscale ? group : 0};
  const Out out{y, f32, n, gscale ? nullptr : row_scale, bias, 1.f};
  run(xf.data(), M, W, blocks, out);
}

void qmatmul_int4_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2,
                       const c10::Half* scale, const c10::Half* min, int64_t group, const float* bias, int64_t n, void* y) {
  const auto xf = float_input(x, f32, M, K, K2);
  const Weights W{w, K2, Code::kInt4, scale, min, group};
  const Out out{y, f32, n, nullptr, bias, 1.f};
  run(xf.data(), M, W, blocks, out);
}

}  // namespace sieve

#endif
