// int4 weights against int8 activations (CPU: AVX2, AVX512-VNNI where the build has it, and AMX-INT8 tiles for calls of
// many rows where the CPU has them): llama.cpp's Q4 x Q8 dot products, for `activation_quantization="int8"`. The
// weights stay in the blocked int4 layout of qmatmul.cpp (block_int4 in sieve/quant/kernels.py); each call quantizes
// its input rows, per row and per 32 inputs b, to int8:
//   d_b = max|x| * (1/127),  q = round-half-even(x * (1 / d_b)) in [-127, 127],  xs_b = sum of x (float32)
// and an output is, over b in order,
//   acc = fma(float(sum_k w_k q_k), s * d_b, acc),  acc = fma(m, xs_b, acc)
// with w_k the codes 0..15, s and m the scale and min of b's weight group (Q4_0: m = -8 s). The integer sums
// are exact, so a row's result does not depend on the batch (every row takes the same path), and
// sieve/quant/q8_activations.py computes the same numbers in PyTorch. Lossy: the activations keep 8 bits
// (their cost is measured in docs/quality.md); the weights are the file's, exactly.
//
// Why: above one row the float32 kernels are bound by this CPU's FMAs (a 4-row int4 step runs two-thirds of
// the 2 cores' float32 peak), which is what a decode step that verifies drafted tokens pays. Here one
// vpmaddubsw multiplies 32 weight nibbles (unsigned) by 32 activation bytes (signed) and adds them in pairs:
// the 16-bit word r of a unit (inputs 4u .. 4u + 3 of the block's 16 rows) holds row r's codes for inputs
// 4u, 4u + 1 in its low nibbles and 4u + 2, 4u + 3 in its high ones, so the masked low nibbles against the
// broadcast pair (q_4u, q_4u+1) give each row's two products summed, and the high nibbles the next two.
// A word sums at most 4 units (4 x 4 x 15 x 127 = 30480 < 2^15) before it widens to 32 bits.
//
// With AVX512-VNNI (a build for a CPU that has it), vpdpbusd takes 4 bytes of a 32-bit lane at once, with no
// 16-bit stage: interleaving a unit's low and high nibbles word by word (vpunpck[lh]wd) gives, per lane, one
// output row's codes for inputs 4u .. 4u + 3, and one dot product of that against the broadcast int8 quad
// (q_4u .. q_4u+3) adds the 4 products into the row's 32-bit sum; 16 rows per register, one instruction per
// unit and row against ~5 above. The integer sums are the same exact numbers, and the float steps the same
// operations in the same order, so the two kernels give the same bits (tests/test_q8_activations.py).
#include "kernels.h"

#include <atomic>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sieve {

namespace {

constexpr int64_t kQ8Block = 32;  // inputs per activation scale
constexpr int64_t kPrefetchQ = 384;
constexpr int64_t kMR = 8;  // rows per pass over a block (its bytes stay in L1 between passes)

// 16 float16 values of rows 0..15 -> float32, even rows in `e`, odd rows in `o`
inline void even_odd_h(const c10::Half* p, __m256& e, __m256& o) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 a = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), even);
  const __m256 b = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), even);
  e = _mm256_permute2f128_ps(a, b, 0x20), o = _mm256_permute2f128_ps(a, b, 0x31);
}

struct OutQ {
  void* y;
  bool f32;
  int64_t N;
  const float* bias;
  void store(__m256 acc_e, __m256 acc_o, int64_t m, int64_t blk) const {  // even/odd rows back in order
    const __m256 lo = _mm256_unpacklo_ps(acc_e, acc_o), hi = _mm256_unpackhi_ps(acc_e, acc_o);
    alignas(32) float v[16];
    _mm256_store_ps(v, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_store_ps(v + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    write(v, m, blk);
  }
  void write(const float (&v)[16], int64_t m, int64_t blk) const {  // row m's outputs of block blk, plus the bias
    const int64_t n0 = blk * 16, cnt = std::min<int64_t>(16, N - n0);
    for (int64_t i = 0; i < cnt; ++i) {
      const float r = v[i] + (bias ? bias[n0 + i] : 0.f);
      if (f32) static_cast<float*>(y)[m * N + n0 + i] = r;
      else static_cast<c10::BFloat16*>(y)[m * N + n0 + i] = c10::BFloat16(r);
    }
  }
};

// One block of 16 outputs against rows m0 .. m0 + MR - 1
template <int MR>
void int4_q8_rows(const Q8Rows& X, const uint8_t* w, int64_t K2, const c10::Half* scale, const c10::Half* min, int64_t group, int64_t m0,
                  int64_t blk, const OutQ& out) {
  const int64_t G = K2 / group, per_group = group / kQ8Block;
  const uint8_t* base = w + blk * (K2 / 4) * 32;
  const c10::Half* sp = scale + blk * G * 16;
  const c10::Half* mp = min ? min + blk * G * 16 : nullptr;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc_e[MR], acc_o[MR];
  for (int m = 0; m < MR; ++m) acc_e[m] = acc_o[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 se, so, me, mo;
    even_odd_h(sp + g * 16, se, so);
    if (mp) even_odd_h(mp + g * 16, me, mo);
    else me = _mm256_mul_ps(se, _mm256_set1_ps(-8.f)), mo = _mm256_mul_ps(so, _mm256_set1_ps(-8.f));
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i sum_e[MR], sum_o[MR];
      for (int m = 0; m < MR; ++m) sum_e[m] = sum_o[m] = _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {  // 4 units decoded once (8 registers), then each row against them
        const int64_t u0 = b * 8 + half * 4;
        _mm_prefetch(reinterpret_cast<const char*>(base + u0 * 32 + kPrefetchQ), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(base + u0 * 32 + kPrefetchQ + 64), _MM_HINT_T0);
        __m256i lo[4], hi[4];
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (u0 + j) * 32));
          lo[j] = _mm256_and_si256(v, nib), hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int m = 0; m < MR; ++m) {
          const int32_t* xp = X.pairs.data() + ((m0 + m) * X.units + u0) * 2;
          __m256i a = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(xp[0]));
          __m256i c = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(xp[1]));
          for (int j = 1; j < 4; ++j) {
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(xp[2 * j])));
            c = _mm256_add_epi16(c, _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(xp[2 * j + 1])));
          }
          a = _mm256_add_epi16(a, c);  // words -> even rows (low words) and odd rows (high words), 32 bits
          sum_e[m] = _mm256_add_epi32(sum_e[m], _mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16));
          sum_o[m] = _mm256_add_epi32(sum_o[m], _mm256_srai_epi32(a, 16));
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 d = _mm256_set1_ps(X.d[(m0 + m) * X.nb + b]), xs = _mm256_set1_ps(X.xs[(m0 + m) * X.nb + b]);
        acc_e[m] = _mm256_fmadd_ps(me, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_e[m]), _mm256_mul_ps(se, d), acc_e[m]));
        acc_o[m] = _mm256_fmadd_ps(mo, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_o[m]), _mm256_mul_ps(so, d), acc_o[m]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) out.store(acc_e[m], acc_o[m], m0 + m, blk);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The same products with vpdpbusd, MR rows against NB blocks of 16 outputs walked side by side (NB read streams,
// and NB x MR independent sums, so that consecutive dot products do not wait on each other at one row; as the
// float32 kernel's tiles in qmatmul.cpp). Two units (64 bytes) per load: after the nibble interleave, lane order is
// rows 0-3, 8-11 | 4-7, 12-15 for each unit (permuted into one register per unit); the sums stay in that order and
// the scales and mins are permuted to it, so only the final store puts rows back in order.
template <int MR, int NB>
void int4_q8_tile_vnni(const Q8Rows& X, const uint8_t* w, int64_t K2, const c10::Half* scale, const c10::Half* min, int64_t group,
                       int64_t m0, const int64_t* blk, const OutQ& out) {
  constexpr int S = MR * NB <= 4 ? 2 : 1;  // sums per (row, block): the two units of a load in separate chains
  const int64_t G = K2 / group, per_group = group / kQ8Block;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  // unpacklo / unpackhi of a 2-unit register: 64-bit halves [A0-3, A8-11, B0-3, B8-11] and [A4-7, A12-15, B4-7, B12-15]
  const __m512i take_a = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), take_b = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  // lane j of a sum register holds row order[j]: rows 0-3, 8-11, 4-7, 12-15
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = w + blk[j] * (K2 / 4) * 32;
  const int32_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K2);
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  auto group_vec = [&](const c10::Half* p, int64_t j, int64_t g) {
    return _mm512_permutexvar_ps(order, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (blk[j] * G + g) * 16))));
  };
  for (int64_t g = 0; g < G; ++g) {
    __m512 s[NB], mn[NB];
    for (int j = 0; j < NB; ++j) {
      s[j] = group_vec(scale, j, g);
      mn[j] = min ? group_vec(min, j, g) : _mm512_mul_ps(s[j], _mm512_set1_ps(-8.f));
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m512i sum[MR][NB][S];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NB; ++j)
          for (int t = 0; t < S; ++t) sum[m][j][t] = _mm512_setzero_si512();
      for (int pair = 0; pair < 4; ++pair) {  // 8 units of the block, two at a time
        const int64_t u0 = b * 8 + pair * 2;
        for (int j = 0; j < NB; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(base[j] + u0 * 32 + kPrefetchQ), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(base[j] + u0 * 32);
          const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          const __m512i il = _mm512_unpacklo_epi16(lo, hi), ih = _mm512_unpackhi_epi16(lo, hi);
          const __m512i wa = _mm512_permutex2var_epi64(il, take_a, ih), wb = _mm512_permutex2var_epi64(il, take_b, ih);
          for (int m = 0; m < MR; ++m) {
            sum[m][j][0] = _mm512_dpbusd_epi32(sum[m][j][0], wa, _mm512_set1_epi32(xq[m][u0]));
            sum[m][j][S - 1] = _mm512_dpbusd_epi32(sum[m][j][S - 1], wb, _mm512_set1_epi32(xq[m][u0 + 1]));
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_set1_ps(X.d[(m0 + m) * X.nb + b]), xs = _mm512_set1_ps(X.xs[(m0 + m) * X.nb + b]);
        for (int j = 0; j < NB; ++j) {
          const __m512i total = S == 2 ? _mm512_add_epi32(sum[m][j][0], sum[m][j][S - 1]) : sum[m][j][0];
          acc[m][j] = _mm512_fmadd_ps(mn[j], xs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s[j], d), acc[m][j]));
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MR; ++m) {
      alignas(64) float v[16];
      _mm512_store_ps(v, _mm512_permutexvar_ps(order, acc[m][j]));  // the order is its own inverse (rows 4-7 <-> 8-11)
      out.write(v, m0 + m, blk[j]);
    }
}

void qmatmul_vnni(const Q8Rows& X, const uint8_t* w, int64_t blocks, int64_t K2, const c10::Half* scale, const c10::Half* min,
                  int64_t group, int64_t M, const OutQ& out) {
  // a row's sums are the same exact integers, and its float steps the same, whatever the tile: rows never mix
  auto tile = [&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
    int4_q8_tile_vnni<MR, B>(X, w, K2, scale, min, group, m0, blk, out);
  };
  if (M <= 2) sweep<2, 3>(M, blocks, tile);  // (kernels.h: threads split the blocks, NB read streams each)
  else if (M <= 4) sweep<4, 2>(M, blocks, tile);
  else sweep<8, 1>(M, blocks, tile);
}
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
void qmatmul_vnni(const Q8Rows&, const uint8_t*, int64_t, int64_t, const c10::Half*, const c10::Half*, int64_t, int64_t, const OutQ&) {}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The same products on AMX tiles (AMX-INT8's tdpbsud: signed bytes of A against unsigned bytes of B, summed exactly in
// 32 bits). One block b of 32 inputs against 16 outputs is one tile product: B is the block's 8 units decoded exactly
// as the VNNI kernel decodes them (a 2-unit load's wa and wb are B's rows 2p and 2p + 1; a 32-bit lane holds one
// output's codes for 4 consecutive inputs, VNNI order, the lanes in the VNNI kernel's row order), A is up to 16 rows'
// 32 int8 codes of b, read where quantize_rows put them. C's integers are vpdpbusd's sums, exactly, and block b ends
// with the VNNI kernel's two FMAs in its order, so every output is that kernel's bits: which of the two multiplies a
// call is a matter of speed alone (`amx_from_rows`), and a row's result never depends on the others.
// What the tiles save is the per-row dot products (8 vpdpbusd per row, block and 16 outputs, against one tile product
// for 16 rows); the decoding and each row's float steps per block remain, and a tile product costs about as much at one
// row as at 16. Measured on the Emerald Rapids host (SmolLM2's int4 linears, 30 layers, time against vpdpbusd): 1 row
// 2.2x, 7 rows 1.1-1.25x, 8 rows 1.0x, 10 rows 0.84x, 12-64 rows 0.73-0.76x, 128 rows 0.85x. So the tiles take calls
// from 10 rows (kAmxFromRows): 8 users' drafts, 32 users, prefill chunks. Tried and not kept: two blocks per tile
// product below 9 rows (A's row 2m + i holding row m's block 2t + i in half i of 64 bytes: a full tile width, half the
// tile operations), 1.75x at 1 row and 1.27x at 7.
constexpr int64_t kAmxRows = 16;
constexpr int kAmxBlocks = 3;  // tiles: 0 = A, 1 .. 3 = B of 3 output blocks, 4 .. 6 = their C
constexpr bool kHaveAmx = true;

// NB blocks of 16 outputs against all M rows (codes xq [Mp, K2], Mp a multiple of 16 where M > 16); acc [M][NB],
// cbuf [2][NB][Mp][16]. Software-pipelined over the 32-input blocks b (int8_tile_pipeline, kernels.h).
template <int NB>
void int4_q8_amx_tile(const int8_t* xq, const Q8Rows& X, int64_t M, const uint8_t* w, int64_t K2, const c10::Half* scale,
                      const c10::Half* min, int64_t group, const int64_t (&blk)[NB], const OutQ& out, __m512* acc, int32_t* cbuf) {
  const int64_t G = K2 / group, per_group = group / kQ8Block, nbk = K2 / kQ8Block, chunks = (M + kAmxRows - 1) / kAmxRows;
  const int64_t Mp = chunks * kAmxRows;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i take_a = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), take_b = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = w + blk[j] * (K2 / 4) * 32;
  for (int64_t i = 0; i < M * NB; ++i) acc[i] = _mm512_setzero_ps();
  auto decode = [&](int64_t b, uint8_t (&bt)[NB][8 * 64]) {
    for (int j = 0; j < NB; ++j)
      for (int pair = 0; pair < 4; ++pair) {
        const int64_t u0 = b * 8 + pair * 2;
        _mm_prefetch(reinterpret_cast<const char*>(base[j] + u0 * 32 + kPrefetchQ), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(base[j] + u0 * 32);
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        const __m512i il = _mm512_unpacklo_epi16(lo, hi), ih = _mm512_unpackhi_epi16(lo, hi);
        _mm512_store_si512(bt[j] + (2 * pair) * 64, _mm512_permutex2var_epi64(il, take_a, ih));
        _mm512_store_si512(bt[j] + (2 * pair + 1) * 64, _mm512_permutex2var_epi64(il, take_b, ih));
      }
  };
  auto group_vec = [&](const c10::Half* p, int64_t j, int64_t g) {
    return _mm512_permutexvar_ps(order, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (blk[j] * G + g) * 16))));
  };
  auto end_block = [&](int64_t b, const int32_t* c) {  // the VNNI kernel's float steps for block b, in its order
    const int64_t g = b / per_group;
    __m512 s[NB], mn[NB];
    for (int j = 0; j < NB; ++j) {
      s[j] = group_vec(scale, j, g);
      mn[j] = min ? group_vec(min, j, g) : _mm512_mul_ps(s[j], _mm512_set1_ps(-8.f));
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512 d = _mm512_set1_ps(X.d[m * X.nb + b]), xs = _mm512_set1_ps(X.xs[m * X.nb + b]);
      for (int j = 0; j < NB; ++j) {
        const __m512i total = _mm512_load_si512(c + (j * Mp + m) * 16);
        __m512& a = acc[m * NB + j];
        a = _mm512_fmadd_ps(mn[j], xs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s[j], d), a));
      }
    }
  };
  int8_tile_pipeline<NB, false>(xq, K2, M, nbk, cbuf, decode, end_block);
  for (int j = 0; j < NB; ++j)
    for (int64_t m = 0; m < M; ++m) {
      alignas(64) float v[16];
      _mm512_store_ps(v, _mm512_permutexvar_ps(order, acc[m * NB + j]));
      out.write(v, m, blk[j]);
    }
}

void qmatmul_amx(const Q8Rows& X, const uint8_t* w, int64_t blocks, int64_t K2, const c10::Half* scale, const c10::Half* min,
                 int64_t group, int64_t M, const OutQ& out) {
  const int8_t* xq = X.q.data();
  std::vector<int8_t> padded;
  xq = whole_tiles(xq, M, K2, padded);  // whole tiles of rows past the first
  // as sweep (kernels.h): a thread walks kAmxBlocks parts of its share side by side, one read stream each
  at::parallel_for(0, blocks, kAmxBlocks, [&](int64_t b0, int64_t b1) {
    load_int8_tiles(std::min(M, kAmxRows));
    std::vector<__m512> acc(M * kAmxBlocks);
    const int64_t Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
    std::vector<__m512i> cbuf(2 * kAmxBlocks * Mp);  // 16 sums a row (aligned as __m512i)
    const int64_t part = (b1 - b0) / kAmxBlocks;
    for (int64_t i = 0; i < part; ++i) {
      int64_t blk[kAmxBlocks];
      for (int j = 0; j < kAmxBlocks; ++j) blk[j] = b0 + j * part + i;
      int4_q8_amx_tile<kAmxBlocks>(xq, X, M, w, K2, scale, min, group, blk, out, acc.data(), reinterpret_cast<int32_t*>(cbuf.data()));
    }
    for (int64_t b = b0 + kAmxBlocks * part; b < b1; ++b) {
      const int64_t one[1] = {b};
      int4_q8_amx_tile<1>(xq, X, M, w, K2, scale, min, group, one, out, acc.data(), reinterpret_cast<int32_t*>(cbuf.data()));
    }
    _tile_release();
  });
}
#else
constexpr bool kHaveAmx = false;
void qmatmul_amx(const Q8Rows&, const uint8_t*, int64_t, int64_t, const c10::Half*, const c10::Half*, int64_t, int64_t, const OutQ&) {}
#endif

// The inner kernel: AVX2's vpmaddubsw, AVX512-VNNI's vpdpbusd, or AMX-INT8's tiles from amx_from_rows rows (VNNI below):
// the same bits, so the default is simply the fastest this CPU and kernel allow
enum InnerKernel : int { kAvx2 = 0, kVnni = 1, kAmx = 2 };
constexpr const char* kKernelNames[] = {"avx2", "avx512-vnni", "amx-int8"};
std::atomic<int> inner_kernel{-1};  // -1: not decided yet (asking Linux for the tiles is done once, on first use)
// From this many rows the tiles are faster than vpdpbusd (see above; docs/design-notes.md, issue 15, twentieth part)
constexpr int64_t kAmxFromRows = 10;
std::atomic<int64_t> amx_from_rows{kAmxFromRows};

int current_kernel() {
  int k = inner_kernel.load(std::memory_order_relaxed);
  if (k < 0) {
    int expected = -1;
    inner_kernel.compare_exchange_strong(expected, kHaveAmx && amx_permitted() ? kAmx : kHaveVnni ? kVnni : kAvx2);
    k = inner_kernel.load();
  }
  return k;
}

}  // namespace

Q8Rows quantize_rows(const void* x, bool f32, int64_t M, int64_t K, int64_t K2, bool pairs) {
  Q8Rows r;
  r.units = K2 / 4, r.nb = K2 / kQ8Block;
  if (pairs) r.pairs.assign(M * r.units * 2, 0);
  r.d.assign(M * r.nb, 0.f), r.xs.assign(M * r.nb, 0.f);
  r.q.assign(M * K2, 0);
  std::vector<float> row(K2, 0.f);
  const __m256 sign = _mm256_set1_ps(-0.f), top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane interleave, undone
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = r.q.data() + m * K2;
    if (f32) std::memcpy(row.data(), static_cast<const float*>(x) + m * K, K * sizeof(float));
    else
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(static_cast<const c10::BFloat16*>(x)[m * K + k]);
    for (int64_t b = 0; b < r.nb; ++b) {  // 32 inputs in 4 registers (llama.cpp's quantize_row_q8_0, AVX2)
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(row.data() + b * kQ8Block + 8 * i);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m256 sm = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
      __m128 mx4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      mx4 = _mm_max_ps(mx4, _mm_movehl_ps(mx4, mx4));
      mx4 = _mm_max_ss(mx4, _mm_movehdup_ps(mx4));
      __m128 sm4 = _mm_add_ps(_mm256_castps256_ps128(sm), _mm256_extractf128_ps(sm, 1));
      sm4 = _mm_add_ps(sm4, _mm_movehl_ps(sm4, sm4));
      sm4 = _mm_add_ss(sm4, _mm_movehdup_ps(sm4));
      const float amax = _mm_cvtss_f32(mx4);
      const float d = amax * (1.f / 127.f), id = d > 0.f ? 1.f / d : 0.f;  // a product: -ffast-math leaves it as it is
      const __m256 mul = _mm256_set1_ps(id);
      __m256i iq[4];
      for (int i = 0; i < 4; ++i) {  // round half to even, as nearbyint in the default mode; |q| <= 127
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        iq[i] = _mm256_cvtps_epi32(_mm256_min_ps(top, _mm256_max_ps(bottom, r)));
      }
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kQ8Block), _mm256_permutevar8x32_epi32(p, order));
      r.d[m * r.nb + b] = d, r.xs[m * r.nb + b] = _mm_cvtss_f32(sm4);
    }
    for (int64_t u = 0; pairs && u < r.units; ++u)
      for (int h = 0; h < 2; ++h) {
        const uint32_t lo = static_cast<uint8_t>(q[4 * u + 2 * h]), hi = static_cast<uint8_t>(q[4 * u + 2 * h + 1]);
        const uint32_t word = lo | (hi << 8);
        r.pairs[(m * r.units + u) * 2 + h] = static_cast<int32_t>(word | (word << 16));
      }
  }
  return r;
}

std::string q8act_kernel() { return kKernelNames[current_kernel()]; }
std::string set_q8act_kernel(const std::string& name) {
  const bool vnni = name == "avx512-vnni" && kHaveVnni, amx = name == "amx-int8" && kHaveAmx;
  TORCH_CHECK(name == "avx2" || vnni || amx, "q8act kernel: avx2", kHaveVnni ? ", avx512-vnni" : "", kHaveAmx ? ", amx-int8" : "",
              " in this build, not ", name);
  TORCH_CHECK(!amx || amx_permitted(), "q8act kernel amx-int8: this kernel does not grant the tile registers");
  const std::string before = q8act_kernel();
  inner_kernel.store(amx ? kAmx : vnni ? kVnni : kAvx2);
  return before;
}
int64_t q8act_amx_rows() { return amx_from_rows.load(); }
int64_t set_q8act_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "q8act amx rows: at least 1, not ", rows);
  return amx_from_rows.exchange(rows);
}

void qmatmul_int4_q8act_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2,
                             const c10::Half* scale, const c10::Half* min, int64_t group, const float* bias, int64_t n, void* y) {
  const int kernel = current_kernel();
  const Q8Rows X = quantize_rows(x, f32, M, K, K2, kernel == kAvx2);
  const OutQ out{y, f32, n, bias};
  if (kernel == kAmx && M >= amx_from_rows.load(std::memory_order_relaxed)) return qmatmul_amx(X, w, blocks, K2, scale, min, group, M, out);
  if (kernel != kAvx2) return qmatmul_vnni(X, w, blocks, K2, scale, min, group, M, out);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        switch (std::min<int64_t>(kMR, M - m0)) {
          case 8: int4_q8_rows<8>(X, w, K2, scale, min, group, m0, b, out); break;
          case 7: int4_q8_rows<7>(X, w, K2, scale, min, group, m0, b, out); break;
          case 6: int4_q8_rows<6>(X, w, K2, scale, min, group, m0, b, out); break;
          case 5: int4_q8_rows<5>(X, w, K2, scale, min, group, m0, b, out); break;
          case 4: int4_q8_rows<4>(X, w, K2, scale, min, group, m0, b, out); break;
          case 3: int4_q8_rows<3>(X, w, K2, scale, min, group, m0, b, out); break;
          case 2: int4_q8_rows<2>(X, w, K2, scale, min, group, m0, b, out); break;
          default: int4_q8_rows<1>(X, w, K2, scale, min, group, m0, b, out); break;
        }
      }
  });
}

}  // namespace sieve

#endif
