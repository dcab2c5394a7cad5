// Matrix products with quantized weights on CPU: y [M, N] = x [M, K] . W^T (+ bias), bf16 activations,
// W in int8 or fp8 (e4m3) with a scale per output row, int8 with a float16 scale per (row, group of
// inputs) (GGUF Q8_0), or int4 in groups along K with a float16 scale and min per (row, group)
// (w = q s + m: GGUF Q4_0 / Q4_1, and zero-point int4); float32 accumulation, bf16 output.
//
// Weights are kept in a blocked layout made at load time (sieve/quant/kernels.py), so that 32 weights
// decoded from memory are directly one operand of an AVX512-BF16 dot product:
//   int8, fp8  [N/16, K/2, 16, 2] bytes: for 16 output rows, the pairs (w[n, 2p], w[n, 2p + 1]);
//   int4       [N/16, K/4, 32] bytes: byte 2c + i of unit u holds w[n, 4u + i] in its low nibble and
//              w[n, 4u + 2 + i] in its high nibble (n = 16 b + c), i.e. two consecutive pair-vectors.
// A pair-vector times a broadcast pair (x[m, 2p], x[m, 2p + 1]) adds into 16 output columns at once
// (vdpbf16ps), so the kernel keeps an MR x NB tile of outputs (MR rows of x, NB blocks of 16 columns)
// in registers, with no horizontal sums; each decoded weight vector serves MR rows of x. One pass over
// a thread's columns per MR rows of x: at batch 1 it is a read stream (NB streams), at batch 32 the
// same weights come back from the core's cache for each group of MR rows.
//
// Decoding 32 weights to bf16, exactly:
//   int8  sign-extend to int32, convert to float, pack two halves to bf16 (|q| <= 128 fits bf16).
//   fp8   shift and mask: the bf16 number 2^-120 times the e4m3 one (see Fp8Decode).
//   int4  0x4300 | q is the bf16 number 128 + q, so a group adds s * sum (128 + q) x + (m - 128 s) * sum x:
//         the scale applies to a per-group accumulator, the min (less 128 s) to the group's sum of x.
// Per-group scales (int8 Q8_0, int4) apply to a group's accumulators once, when the group ends.
//
// At batch 1 and 2 the int4 tile keeps two accumulators per output block (one per nibble) and walks 3
// blocks, so that consecutive dot products do not wait on each other: with one chain per block it was
// latency-bound at 25 GB/s per core on L3-resident weights, 46-54 GB/s with two (measured on this
// Zen 4, 4096 x 1536, group 32); from DRAM, 25 -> 29 GB/s. Every stream also prefetches kPrefetch
// bytes ahead (+10% on SmolLM2's small matrices from DRAM). Tried and not kept: splitting an int8 byte
// (q + 128) into two nibbles that each become a bf16 operand with one OR: twice as fast on L3-resident
// weights at batch 1, but no faster from DRAM, where the conversions already keep up, and half the
// speed from batch 4 (two dot products per weight).
// Group scales and mins are float16 [N/16, G, 16]: the 16 rows of a block for one group side by side.
//
// From 2 rows of x on, where this CPU gives the same bits both ways and it is faster, the int8 and int4 tiles take
// each vdpbf16ps as the two float32 FMAs it is defined as (tile_q8_fma, tile_int4_fma, `use_fma_dots`): on the Emerald
// Rapids host one vdpbf16ps holds a port for 2 cycles while FMAs issue 2 a cycle (SmolLM2 Q4_1, float32, a decode step
// of 2/4/8 rows 6.0/9.7/17.6 -> 4.8/6.9/11.7 ms, bit for bit). One row stays on vdpbf16ps: it is bound by memory.
// From kPanelFromInt4 (24) / kPanelFromInt8 (16, int8 with group scales) rows the FMA form decodes each pair of blocks once into a float32
// panel and runs its tiles from there (make_panel, over_panels): the same bits again, and a prefill chunk's or a
// large batch's products 1.1-1.2x (int4) / 1.2-1.45x (Q8_0) faster on the Emerald Rapids host.
#include "kernels.h"

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace sieve {

namespace {

constexpr int64_t kPrefetch = 384;  // bytes ahead in each weight stream
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0); }

inline __m512 dot(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
inline __m512i set_words(uint16_t v) { return _mm512_set1_epi16(static_cast<short>(v)); }
inline __m512i load32(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// 32 weights (one pair-vector) from 32 bytes
struct Int8Decode {
  static __m512i run(const uint8_t* p) {
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
};

// e4m3 -> bf16 in three operations: sign-extend the byte to 16 bits and shift left by 4, which puts
// exponent and mantissa in bf16's low exponent bits and mantissa with the sign copied into bits 11-15;
// the mask keeps bit 15 as the sign. The bf16 number is the e4m3 one times 2^-120 (the bias stays 7
// where bf16's is 127), exact for zero and normal codes; quantize_fp8 writes no subnormal codes. The
// callers scale by 2^120: the inputs by 2^kFp8InputShift before the dot products (which flush
// subnormal products to zero), the row scale by the rest.
struct Fp8Decode {
  static __m512i run(const uint8_t* p) {
    const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_and_si512(_mm512_slli_epi16(s, 4), set_words(0x87F0));
  }
};
constexpr int kFp8Shift = 120, kFp8InputShift = 64;  // |x| < 2^63 keeps x * 2^64 finite in bf16

inline __m512i bcast_pair(const uint16_t* x) {  // (x[0], x[1]) into every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

struct Out {  // where and how a tile is written: y = acc * row_scale + bias, as bf16 or float32
  void* y;
  bool f32;  // y holds float32 (else bf16)
  int64_t N;
  const float* row_scale;  // [N] or null
  const float* bias;       // [N] float32, or null
  float post = 1.f;        // a factor on top of row_scale

  template <int MR, int NB>
  void store(__m512 (&acc)[MR][NB], int64_t m0, const int64_t (&blk)[NB]) const {
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = blk[b] * 16;
      const __mmask16 mask = N - n0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
      const __m512 s = row_scale ? _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row_scale + n0), _mm512_set1_ps(post)) : _mm512_set1_ps(post);
      const __m512 c = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) {
        const __m512 v = _mm512_fmadd_ps(acc[m][b], s, c);
        const int64_t at = (m0 + m) * N + n0;
        if (f32) _mm512_mask_storeu_ps(static_cast<float*>(y) + at, mask, v);
        else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
};

inline __m512 load_halves(const c10::Half* p) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// int8 / fp8: an MR x NB tile over the whole of K. With group scales (`gscale`, float16 [N/16, G, 16],
// int8), each group of inputs has its own accumulators, scaled when the group ends. `pair(a, p)` adds input pair p of
// every row of x into a; the forms below (codes decoded for vdpbf16ps, for FMAs, or read from a float32 panel) differ
// only there.
template <int MR, int NB, class Pair>
void tile_q8_frame(int64_t K2, int64_t m0, const int64_t (&blk)[NB], const Out& out, const c10::Half* gscale, int64_t group,
                   const Pair& pair) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const int64_t Kh = K2 / 2;
  if (gscale == nullptr) {
    for (int64_t p = 0; p < Kh; ++p) pair(acc, p);
  } else {
    const int64_t G = K2 / group, pairs = group / 2;
    for (int64_t g = 0; g < G; ++g) {
      __m512 gacc[MR][NB];
      for (int m = 0; m < MR; ++m)
        for (int b = 0; b < NB; ++b) gacc[m][b] = _mm512_setzero_ps();
      for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) pair(gacc, p);
      for (int b = 0; b < NB; ++b) {
        const __m512 sc = load_halves(gscale + (blk[b] * G + g) * 16);
        for (int m = 0; m < MR; ++m) acc[m][b] = _mm512_fmadd_ps(gacc[m][b], sc, acc[m][b]);
      }
    }
  }
  out.store<MR, NB>(acc, m0, blk);
}

// The NB blocks' weight streams of a blocked weight (`unit` bytes per step of each block's stream), and one prefetch
// per 64-byte line as step s is read
template <int NB>
struct Streams {
  const uint8_t* wb[NB];
  Streams(const uint8_t* w, int64_t block_bytes, const int64_t (&blk)[NB]) {
    for (int b = 0; b < NB; ++b) wb[b] = w + blk[b] * block_bytes;
  }
  const uint8_t* at(int b, int64_t s) const { return wb[b] + s * 32; }
  void prefetch_step(int64_t s) const {
    if ((s & 1) == 0)
      for (int b = 0; b < NB; ++b) prefetch(wb[b] + s * 32);
  }
};

template <class Decode, int MR, int NB>
void tile_q8(const uint16_t* x, int64_t K2, const uint8_t* w, int64_t m0, const int64_t (&blk)[NB], const Out& out,
             const c10::Half* gscale, int64_t group) {
  const Streams<NB> ws(w, K2 / 2 * 32, blk);
  tile_q8_frame<MR, NB>(K2, m0, blk, out, gscale, group, [&](__m512 (&a)[MR][NB], int64_t p) {
    ws.prefetch_step(p);
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = Decode::run(ws.at(b, p));
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = bcast_pair(x + (m0 + m) * K2 + 2 * p);
      for (int b = 0; b < NB; ++b) a[m][b] = dot(a[m][b], wv[b], xv);
    }
  });
}

// Input pair p of rows m0 .. m0 + MR - 1 of x (float32) against NB blocks' codes as float32 (we: input 2p, wo: 2p + 1)
// in the order vdpbf16ps adds them: the odd input's product first
template <int MR, int NB>
inline void fma_pair(__m512 (&a)[MR][NB], const float* x, int64_t K2, int64_t m0, int64_t p, const __m512 (&we)[NB], const __m512 (&wo)[NB]) {
  for (int m = 0; m < MR; ++m) {
    const float* xm = x + (m0 + m) * K2 + 2 * p;
    const __m512 x0 = _mm512_set1_ps(xm[0]), x1 = _mm512_set1_ps(xm[1]);
    for (int b = 0; b < NB; ++b) a[m][b] = _mm512_fmadd_ps(we[b], x0, _mm512_fmadd_ps(wo[b], x1, a[m][b]));  // = dot(a, wv, xv)
  }
}

// int8 codes of a pair-vector (16 rows' inputs 2p and 2p + 1) as float32: we (input 2p of each row), wo (2p + 1)
inline void widen_q8(const uint8_t* p, __m512& we, __m512& wo) {
  const __m512i t = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  we = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(t, 24), 24));
  wo = _mm512_cvtepi32_ps(_mm512_srai_epi32(t, 8));
}

// tile_q8 for int8 codes with each vdpbf16ps as its two FMAs (see tile_int4_fma): the 32 bytes of a pair-vector as
// 16 signed words, byte 2c (input 2p of row c) and byte 2c + 1 (input 2p + 1), widened to float32
template <int MR, int NB>
void tile_q8_fma(const float* x, int64_t K2, const uint8_t* w, int64_t m0, const int64_t (&blk)[NB], const Out& out,
                 const c10::Half* gscale, int64_t group) {
  const Streams<NB> ws(w, K2 / 2 * 32, blk);
  tile_q8_frame<MR, NB>(K2, m0, blk, out, gscale, group, [&](__m512 (&a)[MR][NB], int64_t p) {
    ws.prefetch_step(p);
    __m512 we[NB], wo[NB];
    for (int b = 0; b < NB; ++b) widen_q8(ws.at(b, p), we[b], wo[b]);
    fma_pair<MR, NB>(a, x, K2, m0, p, we, wo);
  });
}

struct Int4Args {
  const c10::Half* scale;  // [NBlocks, G, 16]
  const c10::Half* min;    // [NBlocks, G, 16], or null: w = (q - 8) s
  const float* xsum;       // [M, G]: each group's sum of x
  int64_t G, group;
};

// Group g of an int4 tile ends: its sums of (128 + q) x, gacc, become s * gacc + (m - 128 s) * sum(x) in acc (no min:
// (q - 8) s = (128 + q) s - 136 s). Both forms of the tile end their groups here.
template <int MR, int NB>
inline void end_group_int4(__m512 (&acc)[MR][NB], const __m512 (&gacc)[MR][NB], const Int4Args& a, const int64_t (&blk)[NB],
                           int64_t g, int64_t m0) {
  for (int b = 0; b < NB; ++b) {
    const __m512 s = load_halves(a.scale + (blk[b] * a.G + g) * 16);
    const __m512 off = a.min ? _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, load_halves(a.min + (blk[b] * a.G + g) * 16))
                             : _mm512_mul_ps(_mm512_set1_ps(-136.f), s);
    for (int m = 0; m < MR; ++m)
      acc[m][b] = _mm512_fmadd_ps(off, _mm512_set1_ps(a.xsum[(m0 + m) * a.G + g]), _mm512_fmadd_ps(s, gacc[m][b], acc[m][b]));
  }
}

// int4: an MR x NB tile, group by group, two accumulators per (row, block) within a group (gacc: inputs 4u and
// 4u + 1 of each unit, gh: 4u + 2 and 4u + 3), added when the group ends. `unit(gacc, gh, u)` adds unit u of every row
// of x; the forms below (codes decoded for vdpbf16ps, for FMAs, or read from a float32 panel) differ only there.
// kTileOrder: an AMX tile product's order instead (see fma_unit): the two chains (gacc: even inputs, gh: odd) start
// from zero at every 32 inputs, and their sum adds into the group's sum there.
template <int MR, int NB, class Unit, bool kTileOrder = false>
void tile_int4_frame(int64_t m0, const int64_t (&blk)[NB], const Out& out, const Int4Args& a, const Unit& unit) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const int64_t units = a.group / 4, span = kTileOrder ? 8 : units;  // units a chain runs before it is summed
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 gsum[MR][NB];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) gsum[m][b] = _mm512_setzero_ps();
    for (int64_t u0 = g * units; u0 < (g + 1) * units; u0 += span) {
      __m512 gacc[MR][NB], gh[MR][NB];
      for (int m = 0; m < MR; ++m)
        for (int b = 0; b < NB; ++b) gacc[m][b] = gh[m][b] = _mm512_setzero_ps();
      for (int64_t u = u0; u < u0 + span; ++u) unit(gacc, gh, u);
      for (int m = 0; m < MR; ++m)
        for (int b = 0; b < NB; ++b)
          gsum[m][b] = kTileOrder ? _mm512_add_ps(gsum[m][b], _mm512_add_ps(gacc[m][b], gh[m][b])) : _mm512_add_ps(gacc[m][b], gh[m][b]);
    }
    end_group_int4<MR, NB>(acc, gsum, a, blk, g, m0);
  }
  out.store<MR, NB>(acc, m0, blk);
}

template <int MR, int NB>
void tile_int4(const uint16_t* x, int64_t K2, const uint8_t* w, int64_t m0, const int64_t (&blk)[NB], const Out& out,
               const Int4Args& a) {
  const __m512i base = set_words(0x4300), low4 = set_words(0xF);
  const Streams<NB> ws(w, K2 / 4 * 32, blk);
  tile_int4_frame<MR, NB>(m0, blk, out, a, [&](__m512 (&gacc)[MR][NB], __m512 (&gh)[MR][NB], int64_t u) {
    ws.prefetch_step(u);
    __m512i lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i q = load32(ws.at(b, u));
      lo[b] = _mm512_ternarylogic_epi32(q, low4, base, 0xEA);   // (q & 0xf) | 0x4300: inputs 4u, 4u + 1
      hi[b] = _mm512_or_si512(_mm512_srli_epi16(q, 4), base);   // (q >> 4) | 0x4300: inputs 4u + 2, 4u + 3
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i x0 = bcast_pair(x + (m0 + m) * K2 + 4 * u), x1 = bcast_pair(x + (m0 + m) * K2 + 4 * u + 2);
      for (int b = 0; b < NB; ++b) {
        gacc[m][b] = dot(gacc[m][b], lo[b], x0);
        gh[m][b] = dot(gh[m][b], hi[b], x1);
      }
    }
  });
}

// Unit u of rows m0 .. m0 + MR - 1 of x (float32) against NB blocks' numbers 128 + q as float32 (w[i]: input 4u + i of
// each output row), each vdpbf16ps of tile_int4 as its two FMAs: the odd input's product first.
// kTileOrder: as an AMX tile product (tdpbf16ps) adds them instead, which the Intel SDM defines as, per 32 inputs, one
// float32 FMA chain from zero over the even inputs and one over the odd ones, in input order (DAZ, FTZ, nearest even),
// then their sum added to the result: gacc takes inputs 4u and 4u + 2, gh 4u + 1 and 4u + 3. On the Emerald Rapids
// host this gave tdpbf16ps's bits in every one of 588,800 lanes of random tiles (products near underflow, denormal
// inputs, cancelling pairs, exponents spread over 1e-6 .. 1e6, accumulators of zero and of any size).
template <int MR, int NB, bool kTileOrder = false>
inline void fma_unit(__m512 (&gacc)[MR][NB], __m512 (&gh)[MR][NB], const float* x, int64_t K2, int64_t m0, int64_t u,
                     const __m512 (&w0)[NB], const __m512 (&w1)[NB], const __m512 (&w2)[NB], const __m512 (&w3)[NB]) {
  if constexpr (kTileOrder) {
    for (int m = 0; m < MR; ++m) {
      const __m512 x0 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u]), x2 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u + 2]);
      for (int b = 0; b < NB; ++b) gacc[m][b] = _mm512_fmadd_ps(w2[b], x2, _mm512_fmadd_ps(w0[b], x0, gacc[m][b]));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 x1 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u + 1]), x3 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u + 3]);
      for (int b = 0; b < NB; ++b) gh[m][b] = _mm512_fmadd_ps(w3[b], x3, _mm512_fmadd_ps(w1[b], x1, gh[m][b]));
    }
    return;
  }
  for (int m = 0; m < MR; ++m) {  // the two chains one after the other: half the weight vectors live at a time
    const __m512 x0 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u]), x1 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u + 1]);
    for (int b = 0; b < NB; ++b) gacc[m][b] = _mm512_fmadd_ps(w0[b], x0, _mm512_fmadd_ps(w1[b], x1, gacc[m][b]));  // = dot(gacc, lo, x0)
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 x2 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u + 2]), x3 = _mm512_set1_ps(x[(m0 + m) * K2 + 4 * u + 3]);
    for (int b = 0; b < NB; ++b) gh[m][b] = _mm512_fmadd_ps(w2[b], x2, _mm512_fmadd_ps(w3[b], x3, gh[m][b]));  // = dot(gh, hi, x1)
  }
}

// A unit's 32 bytes (16 output rows' codes of inputs 4u .. 4u + 3) as the float32 numbers 128 + q, w[i] for input 4u + i:
// byte 2c | byte 2c + 1 << 8 holds w[4u] in bits 0-3, w[4u + 2] 4-7, w[4u + 1] 8-11, w[4u + 3] 12-15, and a
// 16-entry table lookup (vpermps reads each lane's low 4 bits) gives 128 + q
inline void widen_int4(const uint8_t* p, __m512& w0, __m512& w1, __m512& w2, __m512& w3) {
  const __m512 lut = _mm512_setr_ps(128, 129, 130, 131, 132, 133, 134, 135, 136, 137, 138, 139, 140, 141, 142, 143);
  const __m512i t = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  w0 = _mm512_permutexvar_ps(t, lut);
  w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(t, 4), lut);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(t, 8), lut);
  w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(t, 12), lut);
}

// The same int4 tile with each vdpbf16ps replaced by the two float32 FMAs it is defined as (Intel SDM: the odd
// pair's product first, then the even one's, each rounded to nearest even, DAZ and FTZ): on the Emerald Rapids host
// one vdpbf16ps takes 2 cycles of one port while FMAs issue 2 a cycle, so from 2 rows of x on, the emulation does the
// same arithmetic in about half the cycles (`bf16_dot_kernel` below says where it is used, and that it gives the
// same bits). x is the bf16-rounded input widened to float32 ([M, K2], exact); a unit's 32 bytes become 16 words, one
// per output row, and a table lookup on each nibble gives the float32 number 128 + q that the bf16 path multiplies
// (widen_int4). The caller sets DAZ and FTZ (`FlushDenormals`), as vdpbf16ps has them.
// kTileOrder: the AMX tiles' order (fma_unit), so that below the rows where tiles pay a row gets their bits.
template <int MR, int NB, bool kTileOrder = false>
void tile_int4_fma(const float* x, int64_t K2, const uint8_t* w, int64_t m0, const int64_t (&blk)[NB], const Out& out,
                   const Int4Args& a) {
  const Streams<NB> ws(w, K2 / 4 * 32, blk);
  auto unit = [&](__m512 (&gacc)[MR][NB], __m512 (&gh)[MR][NB], int64_t u) {
    ws.prefetch_step(u);
    __m512 w0[NB], w1[NB], w2[NB], w3[NB];
    for (int b = 0; b < NB; ++b) widen_int4(ws.at(b, u), w0[b], w1[b], w2[b], w3[b]);
    fma_unit<MR, NB, kTileOrder>(gacc, gh, x, K2, m0, u, w0, w1, w2, w3);
  };
  tile_int4_frame<MR, NB, decltype(unit), kTileOrder>(m0, blk, out, a, unit);
}

// From kPanelFromInt4 / kPanelFromInt8 rows (below) the FMA form decodes each pair of weight blocks once into a float32
// panel and runs every tile of rows from it, where the tiles above decode a block's codes again for every 8 rows (a
// unit of int4 takes 8 decoding operations for its 32 FMAs at 8 rows, a Q8_0 pair-vector 5 for 16, on the ports the
// FMAs use). A panel holds the codes of NBP blocks (16 * NBP output rows) as float32 [K2][16 * NBP], input by input
// (int4: the numbers 128 + q), and the tiles take them in the order of the FMA tiles above, so every output is the
// same number, bit for bit, at any row count. Each broadcast input then serves 32 outputs (two FMAs) where it served
// 16. The panel (73-196 KB for SmolLM2's K) stays in L2. Writing and rereading it costs more than it saves at small
// row counts (a first version took SmolLM2's 4-row step from 8.2 to 14.0 ms), so they keep the register tiles. Tried
// and not kept: panels of one block under 8-row tiles (each broadcast serving one FMA again: 0.72-0.79x the register
// tiles at 16-64 rows), and 4-row tiles over two blocks (0.98x at 32 rows).
constexpr int kPanelBlocks = 2;

// The codes of NBP blocks as a float32 panel [K2][16 * NBP]: step s of each block's stream (32 bytes: kIn = 4 inputs of
// int4, 2 of int8) widened by `widen(bytes, v)` into v[i], input kIn * s + i
template <int NBP, int kIn, class Widen>
void make_panel(const uint8_t* w, int64_t K2, const int64_t (&blk)[NBP], float* panel, const Widen& widen) {
  const Streams<NBP> ws(w, K2 / kIn * 32, blk);
  constexpr int W = 16 * NBP;
  for (int64_t s = 0; s < K2 / kIn; ++s) {
    ws.prefetch_step(s);
    for (int b = 0; b < NBP; ++b) {
      __m512 v[kIn];
      widen(ws.at(b, s), v);
      for (int i = 0; i < kIn; ++i) _mm512_store_ps(panel + (kIn * s + i) * W + 16 * b, v[i]);
    }
  }
}

template <int MR, int NBP>
void panel_tile_int4(const float* x, int64_t K2, const float* panel, int64_t m0, const int64_t (&blk)[NBP], const Out& out,
                     const Int4Args& a) {
  constexpr int W = 16 * NBP;
  tile_int4_frame<MR, NBP>(m0, blk, out, a, [&](__m512 (&gacc)[MR][NBP], __m512 (&gh)[MR][NBP], int64_t u) {
    __m512 w[4][NBP];
    for (int i = 0; i < 4; ++i)
      for (int b = 0; b < NBP; ++b) w[i][b] = _mm512_load_ps(panel + (4 * u + i) * W + 16 * b);
    fma_unit<MR, NBP>(gacc, gh, x, K2, m0, u, w[0], w[1], w[2], w[3]);
  });
}

template <int MR, int NBP>
void panel_tile_q8(const float* x, int64_t K2, const float* panel, int64_t m0, const int64_t (&blk)[NBP], const Out& out,
                   const c10::Half* gscale, int64_t group) {
  constexpr int W = 16 * NBP;
  tile_q8_frame<MR, NBP>(K2, m0, blk, out, gscale, group, [&](__m512 (&a)[MR][NBP], int64_t p) {
    __m512 we[NBP], wo[NBP];
    for (int b = 0; b < NBP; ++b) {
      we[b] = _mm512_load_ps(panel + (2 * p) * W + 16 * b);
      wo[b] = _mm512_load_ps(panel + (2 * p + 1) * W + 16 * b);
    }
    fma_pair<MR, NBP>(a, x, K2, m0, p, we, wo);
  });
}

constexpr int64_t kPanelChunk = 128;
// From how many rows the FMA form takes panels (SmolLM2-135M, float32, Emerald Rapids, a decode step of n rows against
// the register tiles, 4 alternated rounds: int4 16 / 24 / 32 / 64 / 256 rows 0.94-0.97x / 1.00-1.03x / 1.04-1.12x /
// 1.10-1.16x / 1.13-1.18x; Q8_0 with 8-row tiles 12 / 16 / 32 / 64 / 256 rows 0.94x / 1.10x / 1.24x / 1.40x / 1.45x)
constexpr int64_t kPanelFromInt4 = 24, kPanelFromInt8 = 16;

// M rows of x against every block: the blocks in panels of kPanelBlocks (the last may hold one), split over the
// threads; each thread builds a panel (`make(blk, panel)`) and runs tiles of at most kMaxRows rows over it (`tile`,
// through kernels.h's with_rows),
// as even as they can be (32 rows in tiles of 6: 6, 6, 5, 5, 5, 5, where a 2-row remainder would read the whole panel
// for 2 rows), for each chunk of kPanelChunk rows (whose float32 rows then stay in the core's L2 while every panel
// passes over them)
template <int kMaxRows, class Make, class Tile>
void over_panels(int64_t M, int64_t blocks, int64_t K2, const Make& make, const Tile& tile) {
  const int64_t panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  for (int64_t c0 = 0; c0 < M; c0 += kPanelChunk) {
    const int64_t c1 = std::min(M, c0 + kPanelChunk), tiles = (c1 - c0 + kMaxRows - 1) / kMaxRows;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      FlushDenormals daz;  // the FMA form's float steps flush as vdpbf16ps does (see tile_int4_fma)
      const std::unique_ptr<float, decltype(&std::free)> buffer(
          static_cast<float*>(std::aligned_alloc(64, K2 * 16 * kPanelBlocks * sizeof(float))), &std::free);
      auto rows = [&](auto nb, const auto& blk) {
        constexpr int B = decltype(nb)::value;
        make.template operator()<B>(blk, buffer.get());
        for (int64_t t = 0, m0 = c0; t < tiles; ++t) {
          const int64_t mr = (c1 - c0) / tiles + (t < (c1 - c0) % tiles);
          with_rows<kMaxRows>(mr, [&]<int MR>() { tile.template operator()<MR, B>(m0, blk, buffer.get()); });
          m0 += mr;
        }
      };
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b0 = p * kPanelBlocks;
        const int64_t two[2] = {b0, b0 + 1}, one[1] = {b0};
        if (b0 + 1 < blocks) rows(std::integral_constant<int, 2>{}, two);
        else rows(std::integral_constant<int, 1>{}, one);
      }
    });
  }
}

// Which form the bf16 dot products of several rows take. "fma" where the two-FMA form gives vdpbf16ps's bits on this
// CPU (checked once on random operands across exponents, signs and accumulators: the SDM defines the instruction
// that way, but another vendor's implementation may round otherwise) and runs faster (register-only chains of each,
// timed once: 2 FMAs against one vdpbf16ps per 32 products); "dpbf16" otherwise. Either gives the same outputs
// where "fma" is ever chosen, so the timing cannot change a result.
bool fma_matches_dpbf16() {
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int trial = 0; trial < 4096; ++trial) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float c[16];
    for (int i = 0; i < 32; ++i) {
      const uint32_t r = next() >> 8, e = trial % 5 ? 110 + r % 36 : 1 + r % 250;  // some trials span the whole range
      a[i] = static_cast<uint16_t>(((r >> 20) & 1) << 15 | e << 7 | (r & 0x7F));
      const uint32_t r2 = next() >> 8;
      b[i] = static_cast<uint16_t>(((r2 >> 20) & 1) << 15 | (120 + r2 % 16) << 7 | (r2 & 0x7F));
    }
    for (int i = 0; i < 16; ++i) c[i] = (static_cast<float>(next() >> 9) - 4194304.f) * (trial % 3 ? 1e-4f : 1e-9f);
    const __m512i va = _mm512_load_si512(a), vb = _mm512_load_si512(b);
    const __m512 acc = _mm512_load_ps(c);
    FlushDenormals daz;
    const __m512 want = _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
    const __m512 got = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(va, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(vb, 16)),
                                       _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(va, odd)),
                                                       _mm512_castsi512_ps(_mm512_and_si512(vb, odd)), acc));
    if (_mm512_cmpneq_epi32_mask(_mm512_castps_si512(want), _mm512_castps_si512(got))) return false;
  }
  return true;
}

double seconds_per_32_products(bool fma) {  // the best of 3 timings of 12 independent chains
  double best = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1e-3f * i);
    __m512i a = _mm512_set1_epi32(0x3F803F80), b = _mm512_set1_epi32(0x3F803F81);
    __m512 fa = _mm512_set1_ps(1.0001f), fb = _mm512_set1_ps(0.9999f);
    constexpr int kIters = 20000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < kIters; ++it) {
      for (int i = 0; i < 12; ++i)
        acc[i] = fma ? _mm512_fmadd_ps(fb, fa, _mm512_fmadd_ps(fa, fb, acc[i])) : _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
      asm volatile("" : "+v"(a), "+v"(b), "+v"(fa), "+v"(fb));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float sink = 0.f;
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    asm volatile("" : : "x"(sink));
    best = std::min(best, s / (12.0 * kIters));
  }
  return best;
}

std::atomic<int> fma_dots{-1};  // -1: not decided yet; 0: vdpbf16ps; 1: the two-FMA form
bool fma_dots_exact() {
  static const bool exact = fma_matches_dpbf16();
  return exact;
}

// Rows of x per tile: each decoded weight vector serves this many rows (measured with the model shapes
// of Qwen2.5-0.5B: 8 rows x 3 blocks for one-byte codes, 8 x 2 for int4, beat 6 x 4, 6 x 2 and 12 x 2
// at 32 rows, and tie them at 1 row).
constexpr int kRows = 8;

// sweep<kMR, NB>(M, blocks, tile): kernels.h

// bf16 x * 2^e, exactly, into dst (x is a few thousand values)
void scale_by_power_of_two(const uint16_t* src, int64_t total, int e, uint16_t* dst) {
  const __m512 f = _mm512_set1_ps(std::ldexp(1.f, e));
  for (int64_t i = 0; i < total; i += 16) {
    const __mmask16 mask = total - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (total - i)) - 1);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src + i)), 16));
    _mm256_mask_storeu_epi16(dst + i, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, f)));
  }
}

// x [M, K] (bf16, or float32 rounded to bf16 here) as the kernels read it: bf16 [M, K2] with zero
// padding inputs, scaled by 2^e; in `scratch` unless x already is that
const uint16_t* kernel_input(const void* x, bool f32, int64_t M, int64_t K, int64_t K2, int e, std::vector<uint16_t>& scratch) {
  if (!f32 && K == K2 && e == 0) return static_cast<const uint16_t*>(x);
  scratch.assign(M * K2, 0);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = scratch.data() + m * K2;
    if (!f32) {
      std::memcpy(dst, static_cast<const uint16_t*>(x) + m * K, K * 2);
      continue;
    }
    const float* src = static_cast<const float*>(x) + m * K;
    for (int64_t i = 0; i < K; i += 16) {
      const __mmask16 mask = K - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - i)) - 1);
      _mm256_mask_storeu_epi16(dst + i, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i)));
    }
  }
  if (e != 0) scale_by_power_of_two(scratch.data(), M * K2, e, scratch.data());
  return scratch.data();
}

// bf16 -> float32 (exact), for the FMA tiles
std::vector<float> widen(const uint16_t* x, int64_t total) {
  std::vector<float> out(total);
  for (int64_t i = 0; i < total; ++i) out[i] = static_cast<float>(reinterpret_cast<const bf16*>(x)[i]);
  return out;
}

// Each group's sum of x ([M, K2]): [M, G]
void group_sums(const uint16_t* xp, int64_t M, int64_t K2, int64_t group, std::vector<float>& out) {
  const int64_t G = K2 / group;
  out.resize(M * G);
  const bf16* xb = reinterpret_cast<const bf16*>(xp);
  for (int64_t i = 0; i < M * G; ++i) {
    float acc = 0.f;
    for (int64_t j = 0; j < group; ++j) acc += static_cast<float>(xb[i * group + j]);
    out[i] = acc;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// int4 on AMX (Sapphire Rapids and later, where the kernel lets this process use the tile registers): a group of 32
// inputs against 16 output rows is one bf16 tile product. The B tile is the group's 8 units decoded as tile_int4 does
// (each unit's two pair-vectors, (128 + q) as bf16, are B's rows 2u and 2u + 1: VNNI order), the A tile the group's
// 32 inputs of up to 16 rows of x, and C = sum (128 + q) x per row and output, which ends the group as in every other
// form (end_group_int4's two FMAs). A row's result is the same alone as among others (each row of C is its row of A
// against B). The tile product sums in the order the SDM defines (fma_unit's kTileOrder: two FMA chains, even and odd
// inputs, then their sum), so below int4_amx_rows() rows, where a tile product costs more than the FMAs it replaces,
// FMAs in that order give the same bits. What the tiles buy is rows: one tile product multiplies 16 rows for about
// the cost of one, where the FMA forms pay per row.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxPrefetch = 1024;  // bytes ahead in each block's stream (4 groups of 32)

std::atomic<int> int4_amx{-1};  // -1: not decided; 0: off; 1: on

// Tiles: 0 = A (rows of x), 1 .. 3 = B (a group's decoded weights for up to 3 blocks of outputs), 4 .. 6 = C (their
// products): the blocks' tile products are independent, so one waits on memory while another multiplies
constexpr int kAmxBlocks = 3;

void load_tiles(int64_t rows) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(rows);
  c.colsb[0] = 64;
  for (int b = 0; b < kAmxBlocks; ++b) {
    c.rows[1 + b] = 16;
    c.colsb[1 + b] = 64;
    c.rows[4 + b] = static_cast<uint8_t>(rows);
    c.colsb[4 + b] = 64;
  }
  _tile_loadconfig(&c);
}

// Tile numbers are immediates (the intrinsics paste them into the instruction): block b's B tile is 1 + b, its C 4 + b
template <int b> inline void c_zero() {
  if constexpr (b == 0) _tile_zero(4);
  else if constexpr (b == 1) _tile_zero(5);
  else _tile_zero(6);
}
template <int b> inline void b_load_and_multiply(const void* p) {
  if constexpr (b == 0) { _tile_loadd(1, p, 64); _tile_dpbf16ps(4, 0, 1); }
  else if constexpr (b == 1) { _tile_loadd(2, p, 64); _tile_dpbf16ps(5, 0, 2); }
  else { _tile_loadd(3, p, 64); _tile_dpbf16ps(6, 0, 3); }
}
template <int b> inline void c_store(void* p) {
  if constexpr (b == 0) _tile_stored(4, p, 64);
  else if constexpr (b == 1) _tile_stored(5, p, 64);
  else _tile_stored(6, p, 64);
}

// NB blocks of 16 output rows against all M rows of x (bf16 [Mp, K2], Mp a multiple of 16 when M > 16); acc [M][NB].
// Up to 16 rows (one chunk: a decode and its drafts) the groups run as a software pipeline. Group g + 1's tile products
// are issued as soon as group g's are stored; group g is then ended and group g + 2's weights decoded while the tile
// unit multiplies. Before, every group decoded, multiplied, waited for its products, and ended in turn. Each group's
// arithmetic and the order in which groups end are unchanged, so the bits are the same. Emerald Rapids host, one
// layer's four int4 shapes, 3 / 4 / 9 / 16 rows: 0.111 / 0.118 / 0.151 / 0.229 -> 0.086 / 0.089 / 0.131 / 0.193 ms
// (docs/design-notes.md, issue 15, twenty-third part). Above 16 rows the chunks reuse each group's B tiles, in turn.
template <int NB>
void int4_amx_tile(const uint16_t* x, int64_t M, int64_t K2, const uint8_t* w, const int64_t (&blk)[NB], const Out& out,
                   const Int4Args& a, __m512* acc) {
  const int64_t chunks = (M + kAmxRows - 1) / kAmxRows, sub = a.group / 32, block_bytes = K2 / 4 * 32;
  // each block's B tiles of one group (up to 256 inputs a group), two sets: one group's decoding is written while the
  // tiles of the one before are still being read
  alignas(64) uint16_t btiles[2][NB][8][16 * 32];
  alignas(64) float c[NB][kAmxRows * 16];
  const __m512i base = set_words(0x4300), low4 = set_words(0xF);
  for (int64_t i = 0; i < M * NB; ++i) acc[i] = _mm512_setzero_ps();
  auto decode = [&](int64_t g) {  // group g's weights as B tiles, into btiles[g & 1]
    auto& btile = btiles[g & 1];
    for (int b = 0; b < NB; ++b) {
      const uint8_t* wb = w + blk[b] * block_bytes;
      for (int64_t t = 0; t < sub; ++t)
        for (int64_t i = 0; i < 8; ++i) {
          const uint8_t* p = wb + ((g * sub + t) * 8 + i) * 32;
          if (i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kAmxPrefetch), _MM_HINT_T0);
          const __m512i q = load32(p);
          _mm512_store_si512(btile[b][t] + (2 * i) * 32, _mm512_ternarylogic_epi32(q, low4, base, 0xEA));
          _mm512_store_si512(btile[b][t] + (2 * i + 1) * 32, _mm512_or_si512(_mm512_srli_epi16(q, 4), base));
        }
    }
  };
  auto multiply = [&](int64_t g, int64_t h) {  // C = rows of chunk h . group g's B, for each block
    auto& btile = btiles[g & 1];
    for_tiles<NB>([&]<int b>() { c_zero<b>(); });
    for (int64_t t = 0; t < sub; ++t) {
      _tile_loadd(0, x + h * kAmxRows * K2 + (g * sub + t) * 32, K2 * 2);
      for_tiles<NB>([&]<int b>() { b_load_and_multiply<b>(btile[b][t]); });
    }
  };
  auto store = [&]() { for_tiles<NB>([&]<int b>() { c_store<b>(c[b]); }); };
  auto end_group = [&](int64_t g, int64_t h) {  // acc += s C + (m - 128 s) sum x, for the stored C of chunk h
    __m512 s[NB], off[NB];
    for (int b = 0; b < NB; ++b) {
      s[b] = load_halves(a.scale + (blk[b] * a.G + g) * 16);
      off[b] = a.min ? _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s[b], load_halves(a.min + (blk[b] * a.G + g) * 16))
                     : _mm512_mul_ps(_mm512_set1_ps(-136.f), s[b]);
    }
    const int64_t rows = std::min(kAmxRows, M - h * kAmxRows);
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 xs = _mm512_set1_ps(a.xsum[(h * kAmxRows + m) * a.G + g]);
      for (int b = 0; b < NB; ++b) {
        __m512& r = acc[(h * kAmxRows + m) * NB + b];
        r = _mm512_fmadd_ps(off[b], xs, _mm512_fmadd_ps(s[b], _mm512_load_ps(c[b] + m * 16), r));
      }
    }
  };
  if (chunks == 1) {
    decode(0);
    multiply(0, 0);
    if (a.G > 1) decode(1);
    for (int64_t g = 0; g < a.G; ++g) {
      store();
      if (g + 1 < a.G) multiply(g + 1, 0);
      end_group(g, 0);
      if (g + 2 < a.G) decode(g + 2);
    }
  } else {
    for (int64_t g = 0; g < a.G; ++g) {
      decode(g);
      for (int64_t h = 0; h < chunks; ++h) {
        multiply(g, h);
        store();
        end_group(g, h);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    __m512 row[1][NB];
    for (int b = 0; b < NB; ++b) row[0][b] = acc[m * NB + b];
    out.store<1, NB>(row, m, blk);
  }
}

void qmatmul_int4_amx(const uint16_t* xw, int64_t M, int64_t K2, const uint8_t* w, int64_t blocks, const Out& out,
                      const Int4Args& a) {
  if (M == 0) return;
  std::vector<uint16_t> padded;
  xw = whole_tiles(xw, M, K2, padded);  // whole tiles of rows past the first
  // as sweep (kernels.h): a thread walks kAmxBlocks parts of its share side by side, one read stream each
  at::parallel_for(0, blocks, kAmxBlocks, [&](int64_t b0, int64_t b1) {
    load_tiles(std::min(M, kAmxRows));
    FlushDenormals daz;  // the group ends flush as the other forms' do
    std::vector<__m512> acc(M * kAmxBlocks);
    const int64_t part = (b1 - b0) / kAmxBlocks;
    for (int64_t i = 0; i < part; ++i) {
      int64_t blk[kAmxBlocks];
      for (int j = 0; j < kAmxBlocks; ++j) blk[j] = b0 + j * part + i;
      int4_amx_tile<kAmxBlocks>(xw, M, K2, w, blk, out, a, acc.data());
    }
    for (int64_t b = b0 + kAmxBlocks * part; b < b1; ++b) {
      const int64_t one[1] = {b};
      int4_amx_tile<1>(xw, M, K2, w, one, out, a, acc.data());
    }
    _tile_release();
  });
}
#endif
}  // namespace

bool use_fma_dots() {
  int mode = fma_dots.load(std::memory_order_relaxed);
  if (mode < 0) {
    static const int chosen = fma_dots_exact() && seconds_per_32_products(true) < 0.8 * seconds_per_32_products(false);
    int expected = -1;
    fma_dots.compare_exchange_strong(expected, chosen);
    mode = fma_dots.load();
  }
  return mode == 1;
}

void qmatmul_q8_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2, bool fp8,
                     const float* row_scale, const c10::Half* gscale, int64_t group, const float* bias, int64_t n, void* y) {
  std::vector<uint16_t> scratch;
  const uint16_t* xw = kernel_input(x, f32, M, K, K2, fp8 ? kFp8InputShift : 0, scratch);
  Out out{y, f32, n, gscale ? nullptr : row_scale, bias};
  if (fp8) out.post = std::ldexp(1.f, kFp8Shift - kFp8InputShift);
  std::vector<float> xf;
  if (!fp8 && M >= 2 && use_fma_dots()) xf = widen(xw, M * K2);  // the same bits in fewer cycles (tile_int4_fma)
  if (!xf.empty() && gscale && M >= kPanelFromInt8) {  // group scales (Q8_0): measured there; per-channel int8 keeps its 8 x 3 tiles
    auto make = [&]<int B>(const int64_t (&blk)[B], float* panel) {
      make_panel<B, 2>(w, K2, blk, panel, [](const uint8_t* p, __m512 (&v)[2]) { widen_q8(p, v[0], v[1]); });
    };
    auto tile = [&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B], const float* panel) {
      panel_tile_q8<MR, B>(xf.data(), K2, panel, m0, blk, out, gscale, group);
    };
    // 8 rows x 32 outputs: 16 group sums in registers, the running sums spilled between groups
    return over_panels<8>(M, blocks, K2, make, tile);
  }
  auto body = [&]<int kMR, int NB>(auto decode) {
    using D = decltype(decode);
    if (!xf.empty()) {
      auto tile = [&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
        FlushDenormals daz;
        tile_q8_fma<MR, B>(xf.data(), K2, w, m0, blk, out, gscale, group);
      };
      return sweep<kMR, NB>(M, blocks, tile);
    }
    auto tile = [&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
      FlushDenormals daz;  // both forms flush alike in their float steps too (scales, bias), so they agree bit for bit
      tile_q8<D, MR, B>(xw, K2, w, m0, blk, out, gscale, group);
    };
    sweep<kMR, NB>(M, blocks, tile);
  };
  if (fp8) body.template operator()<kRows, 3>(Fp8Decode{});
  // 5-8 rows: see qmatmul_int4_into. At 9-15 rows the FMA form keeps 4 x 3 tiles (there the 8 + 1 split cost 6-10% more
  // than 4 + 4 + 1 over three streams), and from 16 rows it runs on panels (above)
  else if (gscale && M > kRows / 2 && M <= kRows)
    body.template operator()<kRows, 1>(Int8Decode{});
  else if (gscale) body.template operator()<kRows / 2, 3>(Int8Decode{});  // per-group accumulators take registers too
  else body.template operator()<kRows, 3>(Int8Decode{});
}

void qmatmul_int4_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2,
                       const c10::Half* scale, const c10::Half* min, int64_t group, const float* bias, int64_t n, void* y) {
  std::vector<uint16_t> scratch;
  std::vector<float> xsum;
  const uint16_t* xw = kernel_input(x, f32, M, K, K2, 0, scratch);
  group_sums(xw, M, K2, group, xsum);
  const Out out{y, f32, n, nullptr, bias};
  const Int4Args args{scale, min, xsum.data(), K2 / group, group};
  // two accumulators per block at every batch size: one order of summation, so a row's result does not
  // depend on how many rows share the call (see the top of this file)
  // 5 to 8 rows (a decode verifying 4 to 7 drafted tokens): one pass of 8-row tiles over one stream per thread,
  // instead of a 4-row pass and a second pass that decodes every weight again for the rest (measured on
  // SmolLM2-135M Q4_1, all layers at 5 rows: 11.4 -> 10.1 ms). The order of summation within a row is the same.
  // The FMA form keeps 8-row tiles above 8 rows too, where each decoded weight then serves twice the rows (its
  // decoding is the costly part of that tile): Emerald Rapids, SmolLM2 Q4_1, float32, a decode step of 9 / 16 / 32
  // rows 15.6 / 24.6 / 48.3 -> 15.0 / 22.1 / 42.7 ms.
  // From kPanelFromInt4 rows, float32 panels (over_panels).
  auto run = [&](const auto& tile, bool fma) {
    if (M <= 2) sweep<2, 3>(M, blocks, tile);
    else if (M <= 4 || (M > kRows && !fma)) sweep<4, 2>(M, blocks, tile);
    else sweep<kRows, 1>(M, blocks, tile);
  };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (group % 32 == 0 && group <= 256 && use_int4_amx()) {
    if (M >= int4_amx_rows()) return qmatmul_int4_amx(xw, M, K2, w, blocks, out, args);
    // fewer rows: FMAs in the tiles' own order (fma_unit), the same bits at the FMA form's speed
    const std::vector<float> xf = widen(xw, M * K2);
    return run([&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
      FlushDenormals daz;  // as tdpbf16ps: denormal inputs as zero, denormal results flushed
      tile_int4_fma<MR, B, true>(xf.data(), K2, w, m0, blk, out, args);
    }, true);
  }
#endif
  if (M >= 2 && use_fma_dots()) {  // the same bits in fewer cycles where vdpbf16ps is slow (see tile_int4_fma)
    const std::vector<float> xf = widen(xw, M * K2);
    // 6 rows x 32 outputs: 24 group sums (two chains; GCC spills 2 of them), the running sums spilled between groups
    if (M >= kPanelFromInt4) {
      auto make = [&]<int B>(const int64_t (&blk)[B], float* panel) {
        make_panel<B, 4>(w, K2, blk, panel, [](const uint8_t* p, __m512 (&v)[4]) { widen_int4(p, v[0], v[1], v[2], v[3]); });
      };
      auto tile = [&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B], const float* panel) {
        panel_tile_int4<MR, B>(xf.data(), K2, panel, m0, blk, out, args);
      };
      return over_panels<6>(M, blocks, K2, make, tile);
    }
    return run([&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
      FlushDenormals daz;
      tile_int4_fma<MR, B>(xf.data(), K2, w, m0, blk, out, args);
    }, true);
  }
  run([&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
    FlushDenormals daz;  // as the FMA form's (see qmatmul_q8_into)
    tile_int4<MR, B>(xw, K2, w, m0, blk, out, args);
  }, false);
}

std::string bf16_dot_kernel() { return use_fma_dots() ? "fma" : "dpbf16"; }

// Whether int4 weights (groups of 32 to 256 inputs) multiply on AMX tiles (above): by default wherever the CPU has them and
// Linux grants them; SIEVE_INT4_AMX=0 keeps the vdpbf16ps / FMA forms, 1 asks for the tiles (the Python side fails
// closed where there are none). Calls of int4_amx_rows() rows and more take the tiles, fewer rows FMAs in the tiles' own
// order (tile_int4_fma<..., true>): the same bits, so a row's result does not depend on the rows beside it. Emerald
// Rapids host, SmolLM2-135M Q4_1's 120 int4 linears, ms, the three interleaved: 1 / 2 / 3 / 4 / 8 / 16 rows FMA form
// 4.72 / 5.32 / 6.33 / 7.47 / 15.69 / 28.35, FMAs in tile order 4.66 / 5.10 / 7.06 / 8.11 / 15.81 / 28.77, tiles
// 5.62 / 5.60 / 6.15 / 6.20 / 10.35 / 13.93. With the tiles' groups pipelined (int4_amx_tile), one layer's four
// shapes at 1 / 2 rows: FMAs in tile order 0.079 / 0.107 ms, tiles 0.072 / 0.088, so the tiles now start at 2 rows
// and one row (memory-bound, level either way) keeps the FMAs. Decided once per process (or by set_int4_amx, for
// tests), never from a timing.
#if defined(__AMX_TILE__)
bool amx_permitted() {  // Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}
#else
bool amx_permitted() { return false; }
#endif
bool use_int4_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  int mode = int4_amx.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char* env = std::getenv("SIEVE_INT4_AMX");
    static const int chosen = !(env && std::string(env) == "0") && amx_permitted();
    int expected = -1;
    int4_amx.compare_exchange_strong(expected, chosen);
    mode = int4_amx.load();
  }
  return mode == 1;
#else
  return false;
#endif
}
bool set_int4_amx(bool on) {
  const bool before = use_int4_amx();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(!on || amx_permitted(), "int4 on AMX: this CPU or kernel does not grant the tile registers");
  int4_amx.store(on ? 1 : 0);
#else
  TORCH_CHECK(!on, "int4 on AMX: this build has no AMX kernel (the CPU has no AMX-BF16)");
#endif
  return before;
}
std::atomic<int64_t> int4_amx_from{2};
int64_t int4_amx_rows() { return int4_amx_from.load(std::memory_order_relaxed); }
int64_t set_int4_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1 && rows <= 4096, "int4 AMX rows: 1 to 4096, not ", rows);
  return int4_amx_from.exchange(rows);
}
int64_t quantized_panel_rows(const std::string& kind) {
  TORCH_CHECK(kind == "int4" || kind == "q8_0" || kind == "int8" || kind == "fp8", "quantized_panel_rows: int4, q8_0, int8 or fp8, not ", kind);
  if (!use_fma_dots() || kind == "fp8" || kind == "int8") return 0;  // fp8 codes take no FMA form; per-channel int8 keeps its tiles
  return kind == "int4" ? kPanelFromInt4 : kPanelFromInt8;
}
bool bf16_dot_fma_exact() { return fma_dots_exact(); }
std::string set_bf16_dot_kernel(const std::string& name) {
  TORCH_CHECK(name == "fma" || name == "dpbf16", "bf16 dot kernel: fma or dpbf16, not ", name);
  const std::string before = bf16_dot_kernel();
  fma_dots.store(name == "fma");
  return before;
}

}  // namespace sieve

#endif
