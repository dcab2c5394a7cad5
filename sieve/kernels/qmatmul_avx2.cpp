// Matrix products with quantized weights on CPUs with AVX2 + FMA + F16C and no AVX512-BF16 (most
// laptops and desktops, older servers): the same weights in the same blocked layouts as qmatmul.cpp
// (sieve/quant/kernels.py makes them), with no bf16 dot product to lean on. Built when the CPU (or
// SIEVE_CPU_ISA=avx2) has no AVX512-BF16; see sieve/kernels/__init__.py.
//
// The weights are decoded to float32, exactly, and multiplied by float32 inputs with FMAs:
//   int8  sign-extend, convert                             w = q            (row scale at the store)
//   fp8   e4m3 bits moved into float32's (no subnormal codes; quantize_fp8 writes none), times 2^120
//   Q8_0  int8 times its group's float16 scale             w = q * s        (exact: 8 x 11 bits)
//   int4  the nibbles of a unit, zero-extended             q, exact; a group's sums take s and m (Q4_0:
//         m = -8 s) once: s * sum(q x) + m * sum(x), see Int4Lanes
// A 32-byte pair-vector (16 rows x 2 inputs, bytes interleaved per row) splits with one byte shuffle
// into rows 0-7 and 8-15 of each input.
//
// Each output sums its products over the inputs in order, in one float32 accumulator, whatever the
// batch, so that a row's result does not depend on how many rows share the call:
//   - 1 row (decode): weights decoded on the fly, three blocks of 16 outputs walked side by side (three
//     read streams per thread; six accumulators hide the FMA latency); int4, int8 and Q8_0 without
//     shuffles (Int4Lanes, Int8Lanes);
//   - more rows: a block's weights decoded once into a float32 panel [K, 16] that stays in the core's
//     cache, then tiles of up to 6 rows x 16 outputs run FMAs from it, so that no matrix is widened
//     whole and each decoded weight serves every row.
// Plain bf16 weights above the GEMV's rows take the same panel path (gemm_bf16_avx2_into): without
// AVX512-BF16, ATen's and oneDNN's bf16 GEMMs run ~12x slower than this CPU's float32 ones (on 2 Zen 4
// cores limited to AVX2: 11.8 GFLOP/s against 73 at 256 x 576 x 1536), which made every prefill of a
// bf16 model the slow part of the step.
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
constexpr int64_t kLanesRows = 8;  // up to this many rows, int4/int8 weights are decoded in registers per 4 rows

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
  __m256 s0, s1;  // Q8_0: the current group's scale for rows 0-7 and 8-15
  int64_t group_begin = 0, group_end = 0;  // inputs [begin, end) of the loaded group (none yet: empty)

  void init(const Weights& weights, int64_t block) {
    Wp = &weights, blk = block, base = weights.w + block * weights.block_bytes(), G = weights.group ? weights.K2 / weights.group : 0;
    group_begin = group_end = 0;
  }

  void load_group(int64_t k) {  // compare before dividing: a division per call costs more than the decode
    if (k < group_end && k >= group_begin) return;
    const Weights& W = *Wp;
    const int64_t g = k / W.group;
    group_begin = g * W.group, group_end = group_begin + W.group;
    const c10::Half* sp = W.scale + (blk * G + g) * 16;
    s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 8)));
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
      w[0] = cvt_u8(r0), w[1] = cvt_u8(_mm_srli_si128(r0, 8)), w[2] = cvt_u8(r8), w[3] = cvt_u8(_mm_srli_si128(r8, 8));
      return;  // int4: the codes q; the group's scale and min apply to its sums (int4_panel_rows)
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

// 16 float16 values of rows 0..15 -> float32, the even rows in `e` and the odd ones in `o` (the lane
// order of Int4Lanes and Int8Lanes)
inline void even_odd(const c10::Half* p, __m256& e, __m256& o) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // per 8 rows: evens, then odds
  const __m256 a = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), even);
  const __m256 b = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), even);
  e = _mm256_permute2f128_ps(a, b, 0x20), o = _mm256_permute2f128_ps(a, b, 0x31);
}

// even/odd row accumulators back to rows 0-7 and 8-15, stored as block `blk` of row m of the output
inline void store_even_odd(const Out& out, int64_t blk, __m256 acc_e, __m256 acc_o, int64_t m = 0) {
  const __m256 lo = _mm256_unpacklo_ps(acc_e, acc_o), hi = _mm256_unpackhi_ps(acc_e, acc_o);
  const __m256 acc[2] = {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
  out.store(acc, m, blk);
}

// int4 sums factor per group: sum_k (q_k s + m) x_k = s (sum_k q_k x_k) + m (sum_k x_k), so a group
// accumulates q x alone and then adds acc = fma(acc_q, s, acc), acc = fma(m, xsum, acc), in that
// order, per output, in both paths below (the same bits at any batch). One FMA per weight instead of
// two; the AVX-512 kernel factors the same way.
//
// At one row, without a shuffle: the 16-bit word r of a unit (32 bytes, inputs 4u .. 4u + 3 of 16
// rows) holds row r's four nibbles, input 4u + j at bit 0, 8, 4, 12 for j = 0..3. So each 32-bit lane
// holds rows 2i (low word) and 2i + 1 (high word): a shift and a mask give input k of the 8 even rows,
// or of the 8 odd ones, in float32 lanes (see `input` for how the shift is spared). The pair decoder's shuffle-port work (byte shuffle, extracts,
// 8-byte widenings: 16 shuffles per 64 weights, this CPU's bottleneck at 11 GB/s) becomes integer ALU work.
struct Int4Lanes {
  const uint8_t* base;
  const c10::Half* scale;  // this block's [G, 16]
  const c10::Half* min;
  const float* xsum;       // the row's [G] group sums of x
  __m256 acc_e = _mm256_setzero_ps(), acc_o = _mm256_setzero_ps(), q_e = _mm256_setzero_ps(), q_o = _mm256_setzero_ps();

  // The nibble at bit S is masked in place, q 2^S, and meets x 2^-S (xs, scaled once per call): the
  // product is q x exactly, so the sums are the panel path's bits, one shift fewer per 8 weights.
  template <int S>
  inline void input(__m256i v, __m256i v_hi, __m256 xk) {
    const __m256i mask = _mm256_set1_epi32(0xF << S);
    q_e = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), xk, q_e);
    q_o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v_hi, mask)), xk, q_o);
  }

  inline void unit(int64_t u, const float* xs) {
    if ((u & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(base + u * 32 + kPrefetch), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + u * 32));
    const __m256i v_hi = _mm256_srli_epi32(v, 16);
    input<0>(v, v_hi, _mm256_set1_ps(xs[4 * u]));
    input<8>(v, v_hi, _mm256_set1_ps(xs[4 * u + 1]));
    input<4>(v, v_hi, _mm256_set1_ps(xs[4 * u + 2]));
    input<12>(v, v_hi, _mm256_set1_ps(xs[4 * u + 3]));
  }

  inline void end_group(int64_t g) {  // scale and min of rows 0, 2, .. 14 and 1, 3, .. 15
    __m256 se, so, me, mo;
    even_odd(scale + g * 16, se, so);
    if (min) even_odd(min + g * 16, me, mo);
    else me = _mm256_mul_ps(se, _mm256_set1_ps(-8.f)), mo = _mm256_mul_ps(so, _mm256_set1_ps(-8.f));
    const __m256 xs = _mm256_set1_ps(xsum[g]);
    acc_e = _mm256_fmadd_ps(me, xs, _mm256_fmadd_ps(q_e, se, acc_e));
    acc_o = _mm256_fmadd_ps(mo, xs, _mm256_fmadd_ps(q_o, so, acc_o));
    q_e = q_o = _mm256_setzero_ps();
  }

  void store(const Out& out, int64_t blk) const { store_even_odd(out, blk, acc_e, acc_o); }
};

// x with input 4u + j scaled by 2^-S for the bit S = 0, 8, 4, 12 its nibble sits at (exact: a power of 2,
// and the kernels flush only values below 2^-114, which no activation reaches)
std::vector<float> nibble_scaled(const float* x, int64_t K2) {
  static constexpr float kScale[4] = {1.f, 0x1p-8f, 0x1p-4f, 0x1p-12f};
  std::vector<float> out(K2);
  for (int64_t k = 0; k < K2; ++k) out[k] = x[k] * kScale[k & 3];
  return out;
}

template <int NB>
void int4_row_tile(const float* x, const float* xsum, const Weights& W, const int64_t (&blk)[NB], const Out& out) {
  const int64_t G = W.K2 / W.group, units = W.group / 4;
  Int4Lanes t[NB];
  for (int b = 0; b < NB; ++b)
    t[b] = Int4Lanes{W.w + blk[b] * W.block_bytes(), W.scale + blk[b] * G * 16, W.min ? W.min + blk[b] * G * 16 : nullptr, xsum};
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t u = g * units; u < (g + 1) * units; ++u)
      for (int b = 0; b < NB; ++b) t[b].unit(u, x);
    for (int b = 0; b < NB; ++b) t[b].end_group(g);
  }
  for (int b = 0; b < NB; ++b) t[b].store(out, blk[b]);
}

// int4 at 2-4 rows (a decode and its drafts, a small batch): Int4Lanes' decoding, each decoded lane serving
// MR rows. The panel path would first store and reload every weight as float32 (on a 2-core Zen 3, 2 rows
// took 2.5x one); here a weight costs its one decode plus one FMA per row. Same products, same order per
// output, so the same bits as the one-row and panel paths.
template <int MR>
void int4_lanes_rows(const float* xs, const float* xsum, const Weights& W, int64_t m0, int64_t blk, const Out& out) {
  const int64_t K2 = W.K2, G = K2 / W.group, units = W.group / 4;
  const uint8_t* base = W.w + blk * W.block_bytes();
  const c10::Half* scale = W.scale + blk * G * 16;
  const c10::Half* min = W.min ? W.min + blk * G * 16 : nullptr;
  static constexpr int kShift[4] = {0, 8, 4, 12};
  __m256 acc_e[MR], acc_o[MR];
  for (int m = 0; m < MR; ++m) acc_e[m] = acc_o[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 q_e[MR], q_o[MR];
    for (int m = 0; m < MR; ++m) q_e[m] = q_o[m] = _mm256_setzero_ps();
    for (int64_t u = g * units; u < (g + 1) * units; ++u) {
      if ((u & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(base + u * 32 + kPrefetch), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + u * 32));
      const __m256i v_hi = _mm256_srli_epi32(v, 16);
      for (int j = 0; j < 4; ++j) {
        const __m256i mask = _mm256_set1_epi32(0xF << kShift[j]);
        const __m256 we = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), wo = _mm256_cvtepi32_ps(_mm256_and_si256(v_hi, mask));
        for (int m = 0; m < MR; ++m) {
          const __m256 xk = _mm256_set1_ps(xs[(m0 + m) * K2 + 4 * u + j]);
          q_e[m] = _mm256_fmadd_ps(we, xk, q_e[m]);
          q_o[m] = _mm256_fmadd_ps(wo, xk, q_o[m]);
        }
      }
    }
    __m256 se, so, me, mo;
    even_odd(scale + g * 16, se, so);
    if (min) even_odd(min + g * 16, me, mo);
    else me = _mm256_mul_ps(se, _mm256_set1_ps(-8.f)), mo = _mm256_mul_ps(so, _mm256_set1_ps(-8.f));
    for (int m = 0; m < MR; ++m) {
      const __m256 xsv = _mm256_set1_ps(xsum[(m0 + m) * G + g]);
      acc_e[m] = _mm256_fmadd_ps(me, xsv, _mm256_fmadd_ps(q_e[m], se, acc_e[m]));
      acc_o[m] = _mm256_fmadd_ps(mo, xsv, _mm256_fmadd_ps(q_o[m], so, acc_o[m]));
    }
  }
  for (int m = 0; m < MR; ++m) store_even_odd(out, blk, acc_e[m], acc_o[m], m0 + m);
}

// int8 and Q8_0 at one row, without a shuffle, like Int4Lanes: the 32-bit lane i of a pair-vector holds
// rows 2i and 2i + 1 of inputs k and k + 1 (bytes: row 2i @ k, row 2i @ k + 1, row 2i + 1 @ k, @ k + 1),
// so a left and an arithmetic right shift give 8 sign-extended codes of the even or the odd rows.
// Weights (Q8_0: q * s, exact) and sums (each output over its inputs in order) are the pair decoder's.
struct Int8Lanes {
  const uint8_t* base;
  const c10::Half* scale;  // Q8_0: this block's [G, 16]; int8: null (row scales at the store)
  __m256 se = _mm256_set1_ps(1.f), so = _mm256_set1_ps(1.f);
  __m256 acc_e = _mm256_setzero_ps(), acc_o = _mm256_setzero_ps();

  template <int L>  // byte L of each 32-bit lane, sign-extended, as float32
  static inline __m256 byte(__m256i v) {
    if constexpr (L == 3) return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
    else return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * L), 24));
  }

  inline void pair(int64_t p, const float* x) {  // inputs 2p, 2p + 1
    if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(base + p * 32 + kPrefetch), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + p * 32));
    const __m256 x0 = _mm256_set1_ps(x[2 * p]), x1 = _mm256_set1_ps(x[2 * p + 1]);
    __m256 e0 = byte<0>(v), e1 = byte<1>(v), o0 = byte<2>(v), o1 = byte<3>(v);
    if (scale) e0 = _mm256_mul_ps(e0, se), e1 = _mm256_mul_ps(e1, se), o0 = _mm256_mul_ps(o0, so), o1 = _mm256_mul_ps(o1, so);
    acc_e = _mm256_fmadd_ps(e1, x1, _mm256_fmadd_ps(e0, x0, acc_e));
    acc_o = _mm256_fmadd_ps(o1, x1, _mm256_fmadd_ps(o0, x0, acc_o));
  }

  inline void load_group(int64_t g) { even_odd(scale + g * 16, se, so); }

  void store(const Out& out, int64_t blk) const { store_even_odd(out, blk, acc_e, acc_o); }
};

// int8 and Q8_0 at 2-4 rows: Int8Lanes' decoding, each decoded lane serving MR rows (as int4_lanes_rows)
template <int MR>
void int8_lanes_rows(const float* x, const Weights& W, int64_t m0, int64_t blk, const Out& out) {
  const int64_t K2 = W.K2, G = W.scale ? K2 / W.group : 1, pairs = W.scale ? W.group / 2 : K2 / 2;
  const uint8_t* base = W.w + blk * W.block_bytes();
  const c10::Half* scale = W.scale ? W.scale + blk * G * 16 : nullptr;
  __m256 se = _mm256_set1_ps(1.f), so = _mm256_set1_ps(1.f);
  __m256 acc_e[MR], acc_o[MR];
  for (int m = 0; m < MR; ++m) acc_e[m] = acc_o[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (scale) even_odd(scale + g * 16, se, so);
    for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
      if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(base + p * 32 + kPrefetch), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + p * 32));
      __m256 e0 = Int8Lanes::byte<0>(v), e1 = Int8Lanes::byte<1>(v), o0 = Int8Lanes::byte<2>(v), o1 = Int8Lanes::byte<3>(v);
      if (scale) e0 = _mm256_mul_ps(e0, se), e1 = _mm256_mul_ps(e1, se), o0 = _mm256_mul_ps(o0, so), o1 = _mm256_mul_ps(o1, so);
      for (int m = 0; m < MR; ++m) {
        const __m256 x0 = _mm256_set1_ps(x[(m0 + m) * K2 + 2 * p]), x1 = _mm256_set1_ps(x[(m0 + m) * K2 + 2 * p + 1]);
        acc_e[m] = _mm256_fmadd_ps(e1, x1, _mm256_fmadd_ps(e0, x0, acc_e[m]));
        acc_o[m] = _mm256_fmadd_ps(o1, x1, _mm256_fmadd_ps(o0, x0, acc_o[m]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) store_even_odd(out, blk, acc_e[m], acc_o[m], m0 + m);
}

template <int NB>
void int8_row_tile(const float* x, const Weights& W, const int64_t (&blk)[NB], const Out& out) {
  const int64_t G = W.scale ? W.K2 / W.group : 1, pairs = W.scale ? W.group / 2 : W.K2 / 2;
  Int8Lanes t[NB];
  for (int b = 0; b < NB; ++b) t[b] = Int8Lanes{W.w + blk[b] * W.block_bytes(), W.scale ? W.scale + blk[b] * G * 16 : nullptr};
  for (int64_t g = 0; g < G; ++g) {
    if (W.scale)
      for (int b = 0; b < NB; ++b) t[b].load_group(g);
    for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p)
      for (int b = 0; b < NB; ++b) t[b].pair(p, x);
  }
  for (int b = 0; b < NB; ++b) t[b].store(out, blk[b]);
}

// int4, one block against MR rows of x from a panel of codes [K2][16]: per group, acc_q = sum q x, then
// acc = fma(acc_q, s, acc), acc = fma(m, xsum, acc) (Int4Lanes' arithmetic, rows in natural order)
template <int MR>
void int4_panel_rows(const float* x, const float* xsum, const Weights& W, const float* panel, int64_t m0, int64_t blk, const Out& out) {
  const int64_t K2 = W.K2, G = K2 / W.group;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 q[MR][2];
    for (int m = 0; m < MR; ++m) q[m][0] = q[m][1] = _mm256_setzero_ps();
    for (int64_t k = g * W.group; k < (g + 1) * W.group; ++k) {
      const __m256 w0 = _mm256_load_ps(panel + k * 16), w1 = _mm256_load_ps(panel + k * 16 + 8);
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_set1_ps(x[(m0 + m) * K2 + k]);
        q[m][0] = _mm256_fmadd_ps(w0, xb, q[m][0]);
        q[m][1] = _mm256_fmadd_ps(w1, xb, q[m][1]);
      }
    }
    const c10::Half* sp = W.scale + (blk * G + g) * 16;
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 8)));
    __m256 mn0, mn1;
    if (W.min) {
      const c10::Half* mp = W.min + (blk * G + g) * 16;
      mn0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp)));
      mn1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + 8)));
    } else {
      mn0 = _mm256_mul_ps(s0, _mm256_set1_ps(-8.f)), mn1 = _mm256_mul_ps(s1, _mm256_set1_ps(-8.f));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 xs = _mm256_set1_ps(xsum[(m0 + m) * G + g]);
      acc[m][0] = _mm256_fmadd_ps(mn0, xs, _mm256_fmadd_ps(q[m][0], s0, acc[m][0]));
      acc[m][1] = _mm256_fmadd_ps(mn1, xs, _mm256_fmadd_ps(q[m][1], s1, acc[m][1]));
    }
  }
  for (int m = 0; m < MR; ++m) out.store(acc[m], m0 + m, blk);
}

// Each row's sum of x over each group of inputs, in order: [M, K2 / group]
std::vector<float> group_sums(const float* x, int64_t M, int64_t K2, int64_t group) {
  const int64_t G = K2 / group;
  std::vector<float> out(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) acc += x[m * K2 + k];
      out[m * G + g] = acc;
    }
  return out;
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

// One row: each thread walks NB consecutive runs of its blocks side by side (NB read streams);
// tile(blk) takes an array of NB block indices, or of 1 for the remainder.
template <class Tile>
void one_row(int64_t blocks, const Tile& tile) {
  constexpr int NB = 3;
  at::parallel_for(0, blocks, NB, [&](int64_t b0, int64_t b1) {
    const int64_t part = (b1 - b0) / NB;
    for (int64_t i = 0; i < part; ++i) {
      int64_t blk[NB];
      for (int j = 0; j < NB; ++j) blk[j] = b0 + j * part + i;
      tile(blk);
    }
    for (int64_t b = b0 + NB * part; b < b1; ++b) {
      const int64_t one[1] = {b};
      tile(one);
    }
  });
}

void run(const float* x, int64_t M, const Weights& W, int64_t blocks, const Out& out) {
  std::vector<float> xsum;
  if (W.code == Code::kInt4) xsum = group_sums(x, M, W.K2, W.group);
  if (M == 1 && W.code == Code::kInt4) {
    const std::vector<float> xs = nibble_scaled(x, W.K2);
    return one_row(blocks, [&](const auto& blk) { int4_row_tile(xs.data(), xsum.data(), W, blk, out); });
  }
  if (M == 1 && W.code == Code::kInt8) return one_row(blocks, [&](const auto& blk) { int8_row_tile(x, W, blk, out); });
  if (M == 1) return one_row(blocks, [&](const auto& blk) { row_tile(x, W, blk, 0, out); });  // fp8
  if (M <= kLanesRows && (W.code == Code::kInt4 || W.code == Code::kInt8)) {  // a few rows: decode in registers, no panel
    std::vector<float> xs;
    if (W.code == Code::kInt4) {
      xs.resize(M * W.K2);
      for (int64_t m = 0; m < M; ++m) {
        const std::vector<float> r = nibble_scaled(x + m * W.K2, W.K2);
        std::copy(r.begin(), r.end(), xs.begin() + m * W.K2);
      }
    }
    return at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {  // the block's bytes stay in L1 for the next 4 rows
          if (W.code == Code::kInt4) {
            switch (std::min<int64_t>(4, M - m0)) {
              case 4: int4_lanes_rows<4>(xs.data(), xsum.data(), W, m0, b, out); break;
              case 3: int4_lanes_rows<3>(xs.data(), xsum.data(), W, m0, b, out); break;
              case 2: int4_lanes_rows<2>(xs.data(), xsum.data(), W, m0, b, out); break;
              default: int4_lanes_rows<1>(xs.data(), xsum.data(), W, m0, b, out); break;
            }
          } else {
            switch (std::min<int64_t>(4, M - m0)) {
              case 4: int8_lanes_rows<4>(x, W, m0, b, out); break;
              case 3: int8_lanes_rows<3>(x, W, m0, b, out); break;
              case 2: int8_lanes_rows<2>(x, W, m0, b, out); break;
              default: int8_lanes_rows<1>(x, W, m0, b, out); break;
            }
          }
        }
    });
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
      if (W.code == Code::kInt4) {
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          switch (std::min<int64_t>(4, M - m0)) {
            case 4: int4_panel_rows<4>(x, xsum.data(), W, panel, m0, b, out); break;
            case 3: int4_panel_rows<3>(x, xsum.data(), W, panel, m0, b, out); break;
            case 2: int4_panel_rows<2>(x, xsum.data(), W, panel, m0, b, out); break;
            default: int4_panel_rows<1>(x, xsum.data(), W, panel, m0, b, out); break;
          }
        }
        continue;
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

// Rows 16 b .. 16 b + 15 of a plain bf16 [N, K] matrix as a float32 panel [K][16] (rows past N: 0):
// 8 inputs of each row widened by a shift, two 8 x 8 transposes.
void bf16_panel(const uint16_t* w, int64_t N, int64_t K, int64_t blk, float* panel) {
  const int64_t r0 = blk * 16, rows = std::min<int64_t>(16, N - r0);
  int64_t k = 0;
  if (rows == 16) {
    for (; k + 8 <= K; k += 8) {
      for (int half = 0; half < 2; ++half) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (r0 + half * 8 + i) * K + k));
          r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
        }
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        const __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * 16 + half * 8, c[j]);
      }
    }
  }
  for (; k < K; ++k)
    for (int64_t i = 0; i < 16; ++i) {
      uint32_t bits = i < rows ? static_cast<uint32_t>(w[(r0 + i) * K + k]) << 16 : 0u;
      std::memcpy(panel + k * 16 + i, &bits, 4);
    }
}

}  // namespace

void gemm_bf16_avx2_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y) {
  const auto xf = float_input(x, false, M, K, K);
  const Out out{y, false, N, nullptr, bias, 1.f};
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    float* panel = static_cast<float*>(std::aligned_alloc(32, ((K * 16 * sizeof(float) + 31) / 32) * 32));
    for (int64_t b = b0; b < b1; ++b) {
      bf16_panel(wp, N, K, b, panel);
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        switch (std::min<int64_t>(6, M - m0)) {
          case 6: panel_rows<6>(xf.data(), K, panel, m0, b, out); break;
          case 5: panel_rows<5>(xf.data(), K, panel, m0, b, out); break;
          case 4: panel_rows<4>(xf.data(), K, panel, m0, b, out); break;
          case 3: panel_rows<3>(xf.data(), K, panel, m0, b, out); break;
          case 2: panel_rows<2>(xf.data(), K, panel, m0, b, out); break;
          default: panel_rows<1>(xf.data(), K, panel, m0, b, out); break;
        }
      }
    }
    std::free(panel);
  });
}

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
