// Paged decode attention (CPU): one query token per sequence, K/V read in place from the block pool
// through each sequence's block table (no gather, no padding to the longest context).
//
//   q             [num_seqs, num_heads, head_dim]                   float32 | bfloat16 | float16
//   k_pool/v_pool [num_blocks, block_size, num_kv_heads, head_dim]  float32 | bfloat16 | float16 (q's dtype or
//                 another: a 16-bit cache under float32 activations), or fp8 (e4m3) / int8 codes
//   block_tables  [num_seqs, max_blocks] int64
//   context_lens  [num_seqs] int64
//   starts        [num_seqs] int64 or absent: the first key each row sees, as an index into its table's slots
//                 (a sliding window's view: keys before it have left the window); absent: 0
//   k_scale/v_scale  fp8: float32 scalars (x = code * scale); int8: float16 [num_blocks, block_size,
//                    num_kv_heads] (one scale per token and head); otherwise absent
//   returns       [num_seqs, num_heads, head_dim] in q's dtype
//
// Work is split over (sequence, kv head): each item holds its G = num_heads / num_kv_heads query heads
// (grouped-query attention: they share every K/V row read) and walks the sequence's blocks once. With
// AVX-512 or AVX2, consecutive rows of one sequence (a decode and its speculative drafts: context lengths L, L + 1,
// ... through one table) form one item, so the drafts' rows add no K/V reads. Per
// block: the block's keys become float32 (once, in a small scratch) and give G x block_size scores, 16
// tokens' dot products summed by one transpose-and-add tree; an online
// softmax (running max and sum per head, flash-decoding style) rescales the accumulators; the block's
// values, converted once into a small float32 scratch, are added in with their probabilities.
// Vectorised for head sizes 16, 32, 64, 128, 256 and 576 (AVX-512; 576 is DeepSeek's latent attention row) or 16 to
// 128 (AVX2 + FMA); other sizes,
// and CPUs with neither, take a scalar loop with the same arithmetic. bf16 queries over a bf16 pool with AVX512-BF16
// (a bf16 model) take decode_dpbf16: bf16 dot products straight from the pool, no float32 scratch. A group holds at
// most 16 rows, so the same kernel serves a bf16 prefill chunk's rows (decoder.cpp), faster here than SDPA.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace sieve {

namespace {

struct Pool {  // one of K or V
  const void* data;
  at::ScalarType dtype;
  float scale = 1.f;                   // fp8
  const c10::Half* token_scales = nullptr;  // int8: [num_blocks * block_size * num_kv_heads]
};

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride, out_stride;  // elements between sequences' rows of q and of the output
  const int64_t* starts = nullptr;  // per row: the first key it sees (sliding windows), or null: 0
  int64_t start(int64_t s) const { return starts ? starts[s] : 0; }
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t block_stride() const { return block_size * token_stride(); }
};

inline float fp8_to_f32(uint8_t b) {
  const uint32_t sign = (b & 0x80u) << 24, exp = (b >> 3) & 0xF, mant = b & 0x7;
  float v;
  if (exp == 0) {
    v = static_cast<float>(mant) * (1.f / 512.f);
  } else {
    const uint32_t bits = ((exp + 120) << 23) | (mant << 20);
    std::memcpy(&v, &bits, 4);
  }
  uint32_t out;
  std::memcpy(&out, &v, 4);
  out |= sign;
  std::memcpy(&v, &out, 4);
  return v;
}

// An e4m3 byte's bits moved into a float16's place are that float16's bits for the value / kFp8Unit, subnormals
// included: sign to bit 15, the 4 exponent and 3 mantissa bits to bits 7..13 (the float16 exponent's bias is 15
// against e4m3's 7, which is the factor 2^-8). So the vector loads widen codes with one float16 conversion, and
// the pool's scale times kFp8Unit is applied once: folded into the queries for K and into the output for V.
constexpr float kFp8Unit = 256.f;

// element `i` of row `row` (a flat (block, offset, kv head) index times head_dim) as float
inline float element(const Pool& p, int64_t row, int64_t head_dim, int64_t i) {
  const int64_t at = row * head_dim + i;
  switch (p.dtype) {
    case at::kFloat: return static_cast<const float*>(p.data)[at];
    case at::kBFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(p.data)[at]);
    case at::kHalf: return static_cast<float>(static_cast<const c10::Half*>(p.data)[at]);
    case at::kFloat8_e4m3fn: return fp8_to_f32(static_cast<const uint8_t*>(p.data)[at]) * p.scale;
    default: return static_cast<float>(static_cast<const int8_t*>(p.data)[at]) * static_cast<float>(p.token_scales[row]);
  }
}

// Rows that are consecutive positions of one sequence (a decode and the tokens drafted after it, verified in
// the same step): context lengths L, L + 1, ... through the same block table. Such a group walks its K/V once
// for all its rows; each row still sees exactly its own context, so its result is the one it would get alone.
// Returns the first row of each group, then num_seqs.
// A group holds at most kMaxGroupRows rows, so that the rows of a prefill chunk (the same structure: a query per
// position) spread over the threads.
constexpr int64_t kMaxGroupRows = 16;
inline std::vector<int64_t> row_groups(const int64_t* tables, const int64_t* lens, int64_t num_seqs, const Layout& lay) {
  std::vector<int64_t> starts{0};
  for (int64_t s = 1; s < num_seqs; ++s) {
    const int64_t nb = (lens[s] + lay.block_size - 1) / lay.block_size;
    const bool same = lens[s] == lens[s - 1] + 1 && s - starts.back() < kMaxGroupRows &&
                      std::memcmp(tables + s * lay.max_blocks, tables + (s - 1) * lay.max_blocks, nb * sizeof(int64_t)) == 0;
    if (!same) starts.push_back(s);
  }
  starts.push_back(num_seqs);
  return starts;
}

// exp(m - mx): the factor that rescales what a query summed before a tile raised its max to mx (0 on its first tile).
// Where the max stands it is exactly 1, and the caller skips the multiply: the same bits.
inline float rescale(float m, float mx) { return mx == m ? 1.f : std::exp(m - mx); }

// The queries of one work item (rows s0 .. s0 + R - 1 of a row group, the G query heads of kv head kh), scaled,
// as float32 [Q = R G, D]: query i is row i / G, head i % G, and sees keys [qlo[i], qlen[i]). Returns the
// first key any of them sees. The per-item state (m, l, acc) starts empty.
template <typename T>
int64_t item_queries(const T* q, const int64_t* lens, const Layout& lay, int64_t s0, int64_t R, int64_t G, int64_t kh, int64_t D,
                     float scale, std::vector<float>& qf, std::vector<int64_t>& qlen, std::vector<int64_t>& qlo, std::vector<float>& acc,
                     std::vector<float>& m, std::vector<float>& l) {
  const int64_t Q = R * G;
  qf.resize(Q * D);
  acc.assign(Q * D, 0.f);
  m.assign(Q, -1e30f);  // finite: the build uses -ffast-math
  l.assign(Q, 0.f);
  qlen.resize(Q);
  qlo.resize(Q);
  int64_t lo = lens[s0 + R - 1];
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t r = i / G, g = i % G;
    qlen[i] = lens[s0 + r];
    qlo[i] = lay.start(s0 + r);
    lo = std::min(lo, qlo[i]);
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = static_cast<float>(q[(s0 + r) * lay.q_stride + (kh * G + g) * D + d]) * scale;
  }
  return lo;
}

// ---- scalar path ------------------------------------------------------------------------------------------
template <typename T>
void decode_scalar(const T* q, const Pool& k, const Pool& v, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t num_seqs, const Layout& lay, float scale) {
  const int64_t G = lay.num_heads / lay.num_kv_heads, D = lay.head_dim, KVH = lay.num_kv_heads;
  at::parallel_for(0, num_seqs * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, kh = item % KVH, L = lens[s], st = lay.start(s);
      const int64_t* table = tables + s * lay.max_blocks;
      auto row = [&](int64_t t) { return (table[t / lay.block_size] * lay.block_size + t % lay.block_size) * KVH + kh; };
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[s * lay.q_stride + (kh * G + g) * D + d]) * scale;
      scores.assign(G * L, 0.f);
      for (int64_t t = st; t < L; ++t)
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * element(k, row(t), D, d);
          scores[g * L + t] = dot;
        }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t = st; t < L; ++t) mx = std::max(mx, sg[t]);
        for (int64_t t = st; t < L; ++t) sum += (sg[t] = std::exp(sg[t] - mx));
        for (int64_t t = st; t < L; ++t) sg[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = st; t < L; ++t)
        for (int64_t d = 0; d < D; ++d) {
          const float vd = element(v, row(t), D, d);
          for (int64_t g = 0; g < G; ++g) acc[g * D + d] += scores[g * L + t] * vd;
        }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) out[s * lay.out_stride + (kh * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

#if defined(__AVX512F__)
#define SIEVE_DECODE_VEC 1
// ---- vectorised path ----------------------------------------------------------------------------------------
// exp(x) for x <= 0 (scores minus their running max): 2^n * e^r, n = round(x / ln 2), r = x - n ln 2
// (two-part ln 2), e^r by Cephes' degree-6 polynomial; about 1 ulp.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// The online softmax's running max after a tile: max(m, the seen scores). Most tiles do not raise it, and a compare
// says so without the horizontal reduction; the number is the same either way.
inline float tile_max(float m, __m512 s, __mmask16 seen) {
  return _mm512_mask_cmp_ps_mask(seen, s, _mm512_set1_ps(m), _CMP_GT_OQ) ? std::max(m, _mm512_mask_reduce_max_ps(seen, s)) : m;
}

// 16 e4m3 bytes, widened to 16-bit lanes, as float16 bits (the value / kFp8Unit): byte << 8, an arithmetic shift
// right by one (the sign lands in bits 15 and 14), bit 14 cleared.
inline __m256i fp8_as_half(__m256i b) {
  return _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}

// 16 consecutive elements of a K/V row as float32
template <at::ScalarType kType>
inline __m512 load16(const void* base, int64_t at, float scale) {
  if constexpr (kType == at::kFloat) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + at);
  } else if constexpr (kType == at::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (kType == at::kHalf) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at)));
  } else if constexpr (kType == at::kFloat8_e4m3fn) {  // e4m3 bits as float16 bits: the value / kFp8Unit, exactly
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + at)));
    return _mm512_mul_ps(_mm512_cvtph_ps(fp8_as_half(b)), _mm512_set1_ps(scale));
  } else {  // int8 codes, scale per (token, head)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + at));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(scale));
  }
}

template <at::ScalarType kType>
inline float row_scale(const Pool& p, int64_t row) {
  if constexpr (kType == at::kFloat8_e4m3fn) return p.scale * kFp8Unit;  // (load16 / load8 give fp8 codes / kFp8Unit)
  if constexpr (kType == at::kChar) return static_cast<float>(p.token_scales[row]);
  return 1.f;
}

// K/V rows of kv head kh in block j of a table (if the context reaches it) towards L1, a few blocks ahead of the
// one being read: a table's blocks lie anywhere in the pool, and a head's rows within one are strided, so the
// hardware prefetchers do not see them coming. (32 sequences at 256 tokens, bf16: 12.8 -> 7.5 ms of a 30-layer step.)
constexpr int64_t kPrefetchBlocks = 2;
inline void prefetch_block(const Pool& k, const Pool& v, const int64_t* table, int64_t j, int64_t L, int64_t kh, const Layout& lay,
                           int64_t row_bytes) {
  const int64_t bs = lay.block_size, KVH = lay.num_kv_heads;
  if (j * bs >= L) return;
  const int64_t row0 = table[j] * bs * KVH + kh, n = std::min(bs, L - j * bs);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < row_bytes; c += 64) {
      _mm_prefetch(static_cast<const char*>(k.data) + (row0 + t * KVH) * row_bytes + c, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(v.data) + (row0 + t * KVH) * row_bytes + c, _MM_HINT_T0);
    }
}

// 16 x 16 transpose: lane t of out[i] = lane i of in[t]
inline void transpose16(const __m512 (&in)[16], __m512 (&out)[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i+1 of elements 4L, 4L+1 (lo) and 4L+2, 4L+3 (hi)
    a[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + e], per 128-bit lane L: rows 4i..4i+3 of element 4L + e
    b[4 * i] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
    b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {  // out[4L + e]: lane L of b[e], b[4 + e], b[8 + e], b[12 + e]
    const __m512 t0 = _mm512_shuffle_f32x4(b[e], b[4 + e], 0x44), t1 = _mm512_shuffle_f32x4(b[e], b[4 + e], 0xEE);
    const __m512 t2 = _mm512_shuffle_f32x4(b[8 + e], b[12 + e], 0x44), t3 = _mm512_shuffle_f32x4(b[8 + e], b[12 + e], 0xEE);
    out[e] = _mm512_shuffle_f32x4(t0, t2, 0x88);
    out[4 + e] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
    out[8 + e] = _mm512_shuffle_f32x4(t1, t3, 0x88);
    out[12 + e] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
  }
}

// Scores of NQ queries against a tile's keys, kt [D][16] (lane t: token t): 4 partial sums per query (dimensions
// d mod 4), added as (s0 + s1) + (s2 + s3). Every query's arithmetic is the same whatever NQ is.
template <int D, int NQ>
inline void tile_scores(const float* qf, const float* kt, float* scores) {
  __m512 s[NQ][4];
  for (int g = 0; g < NQ; ++g)
    for (int c = 0; c < 4; ++c) s[g][c] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 4)
    for (int c = 0; c < 4; ++c) {
      const __m512 kd = _mm512_loadu_ps(kt + (d + c) * 16);
      for (int g = 0; g < NQ; ++g) s[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * D + d + c]), kd, s[g][c]);
    }
  for (int g = 0; g < NQ; ++g)
    _mm512_storeu_ps(scores + g * 16, _mm512_add_ps(_mm512_add_ps(s[g][0], s[g][1]), _mm512_add_ps(s[g][2], s[g][3])));
}

// acc of NQ queries (CW vectors from dimension 16 c) += p . V over the tile's cnt tokens, after scaling by alpha
template <int D, int CW, int NQ>
inline void tile_values(const float* p, const float* alpha, const float* vf, int64_t vstride, int64_t cnt, int c, float* acc) {
  __m512 a[NQ][CW];
  for (int g = 0; g < NQ; ++g)
    for (int i = 0; i < CW; ++i)
      a[g][i] = alpha[g] == 1.f ? _mm512_loadu_ps(acc + g * D + 16 * (c + i))  // (times 1: the same bits)
                                : _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * (c + i)), _mm512_set1_ps(alpha[g]));
  for (int64_t t = 0; t < cnt; ++t) {
    __m512 v[CW];
    for (int i = 0; i < CW; ++i) v[i] = _mm512_loadu_ps(vf + t * vstride + 16 * (c + i));
    for (int g = 0; g < NQ; ++g)
      for (int i = 0; i < CW; ++i) a[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * 16 + t]), v[i], a[g][i]);
  }
  for (int g = 0; g < NQ; ++g)
    for (int i = 0; i < CW; ++i) _mm512_storeu_ps(acc + g * D + 16 * (c + i), a[g][i]);
}

// An item's queries (a decode and its drafts, times the query heads of one kv head) against its keys, 16 tokens (a
// tile) at a time: the tile's keys are transposed once ([D][16]) so that a query's 16 scores come out of D FMAs in
// one register, with no horizontal sums; the softmax runs on that register; the values of a tile are read once per
// group of queries. A query that sees none of a tile (a shorter row of the group, a sliding window) takes it as an
// exact no-op (scale 1, probabilities 0), so every row's result is bit for bit the one it gets alone.
template <typename T, at::ScalarType kKV, int V>  // V = head_dim / 16
void decode_vec(const T* q, const Pool& k, const Pool& v, const int64_t* tables, const int64_t* lens, T* out,
                int64_t num_seqs, const Layout& lay, float scale) {
  constexpr int D = 16 * V;
  constexpr int CW = V < 4 ? V : 4;  // value vectors per pass over a tile (V % CW == 0)
  constexpr int kQK = 4, kPV = 6;    // queries per pass: 16 score sums, 24 value sums in registers
  // fp8: one scale per pool, folded into the scores (the queries carry K's) and into the output (V's), so that
  // neither tile is multiplied by it element by element
  constexpr bool kFold = kKV == at::kFloat8_e4m3fn;
  const float ks = kFold ? row_scale<kKV>(k, 0) : 1.f, vs = kFold ? row_scale<kKV>(v, 0) : 1.f;
  const int64_t G = lay.num_heads / lay.num_kv_heads, KVH = lay.num_kv_heads, bs = lay.block_size;
  const std::vector<int64_t> starts = row_groups(tables, lens, num_seqs, lay);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, groups * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, kt(D * 16), vf(16 * D), p, alpha, m, l;
    std::vector<int64_t> qlen, qlo;
    for (int64_t item = begin; item < end; ++item) {
      // One item: the rows of a group (R consecutive positions of one sequence) times the G query heads of kv
      // head kh; query i is row i / G, head i % G, and sees tokens [qlo[i], qlen[i]).
      const int64_t grp = item / KVH, kh = item % KVH, s0 = starts[grp], R = starts[grp + 1] - s0, Q = R * G;
      const int64_t L = lens[s0 + R - 1];
      const int64_t* table = tables + s0 * lay.max_blocks;
      const int64_t lo = item_queries(q, lens, lay, s0, R, G, kh, D, scale * ks, qf, qlen, qlo, acc, m, l);
      p.resize(Q * 16);
      alpha.resize(Q);
      for (int64_t j = lo / bs; j * bs < L; ++j) {
        const int64_t n = std::min(bs, L - j * bs);
        const int64_t row0 = table[j] * bs * KVH + kh;  // row of token 0 of this block; token t is row0 + t * KVH
        prefetch_block(k, v, table, j + kPrefetchBlocks, L, kh, lay, D * static_cast<int64_t>(c10::elementSize(kKV)));
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const int64_t cnt = std::min<int64_t>(16, n - t0), base = j * bs + t0;  // tokens [base, base + cnt)
          for (int c = 0; c < V; ++c) {  // keys, transposed
            __m512 rows[16], cols[16];
            for (int64_t t = 0; t < 16; ++t) {
              const int64_t row = row0 + (t0 + t) * KVH;
              rows[t] = t < cnt ? load16<kKV>(k.data, row * D + 16 * c, kFold ? 1.f : row_scale<kKV>(k, row)) : _mm512_setzero_ps();
            }
            transpose16(rows, cols);
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps(&kt[(16 * c + i) * 16], cols[i]);
          }
          int64_t g = 0;
          for (; g + kQK <= Q; g += kQK) tile_scores<D, kQK>(&qf[g * D], kt.data(), &p[g * 16]);
          switch (Q - g) {
            case 1: tile_scores<D, 1>(&qf[g * D], kt.data(), &p[g * 16]); break;
            case 2: tile_scores<D, 2>(&qf[g * D], kt.data(), &p[g * 16]); break;
            case 3: tile_scores<D, 3>(&qf[g * D], kt.data(), &p[g * 16]); break;
            default: break;
          }
          // online softmax of each query over the tokens of the tile it sees
          bool any = false;
          for (g = 0; g < Q; ++g) {
            const int64_t tb = std::max<int64_t>(0, qlo[g] - base), te = std::min(cnt, qlen[g] - base);
            if (te <= tb) {  // none: an exact no-op
              alpha[g] = 1.f;
              _mm512_storeu_ps(&p[g * 16], _mm512_setzero_ps());
              continue;
            }
            any = true;
            const __mmask16 seen = static_cast<__mmask16>(((1u << te) - 1) & ~((1u << tb) - 1));
            const __m512 sg = _mm512_loadu_ps(&p[g * 16]);
            const float mx = tile_max(m[g], sg, seen);
            const __m512 pg = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(sg, _mm512_set1_ps(mx))));
            alpha[g] = rescale(m[g], mx);
            l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(pg);
            m[g] = mx;
            _mm512_storeu_ps(&p[g * 16], pg);
          }
          if (!any) continue;
          // values as float32, once for all queries: a float32 pool's rows as they are (token t at a stride of KVH rows)
          const float* vt = vf.data();
          int64_t vstride = D;
          if constexpr (kKV == at::kFloat) {
            vt = static_cast<const float*>(v.data) + (row0 + t0 * KVH) * D;
            vstride = KVH * D;
          } else {
            for (int64_t t = 0; t < cnt; ++t) {
              const int64_t row = row0 + (t0 + t) * KVH;
              const float rs = kFold ? 1.f : row_scale<kKV>(v, row);
              for (int i = 0; i < V; ++i) _mm512_storeu_ps(&vf[t * D + 16 * i], load16<kKV>(v.data, row * D + 16 * i, rs));
            }
          }
          for (int c = 0; c < V; c += CW) {
            for (g = 0; g + kPV <= Q; g += kPV) tile_values<D, CW, kPV>(&p[g * 16], &alpha[g], vt, vstride, cnt, c, &acc[g * D]);
            switch (Q - g) {
              case 1: tile_values<D, CW, 1>(&p[g * 16], &alpha[g], vt, vstride, cnt, c, &acc[g * D]); break;
              case 2: tile_values<D, CW, 2>(&p[g * 16], &alpha[g], vt, vstride, cnt, c, &acc[g * D]); break;
              case 3: tile_values<D, CW, 3>(&p[g * 16], &alpha[g], vt, vstride, cnt, c, &acc[g * D]); break;
              case 4: tile_values<D, CW, 4>(&p[g * 16], &alpha[g], vt, vstride, cnt, c, &acc[g * D]); break;
              case 5: tile_values<D, CW, 5>(&p[g * 16], &alpha[g], vt, vstride, cnt, c, &acc[g * D]); break;
              default: break;
            }
          }
        }
      }
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t r = i / G, g = i % G;
        const float inv = vs / l[i];
        for (int d = 0; d < D; ++d) out[(s0 + r) * lay.out_stride + (kh * G + g) * D + d] = static_cast<T>(acc[i * D + d] * inv);
      }
    }
  });
}

#if defined(__AVX512BF16__)
constexpr bool dpbf16_head_dim(int64_t d) { return d == 32 || d == 64 || d == 128 || d == 256; }

// bf16 queries over a bf16 cache (a bf16 model's decode), with AVX512-BF16 dot products: the products of two bf16
// numbers are exact in float32, so q.k reads the pool's keys as they are, with no float32 scratch of the block; a
// tile of 16 tokens' scores stays in one register through its online softmax. The probabilities are rounded to bf16
// for P.V (as PyTorch's CPU flash attention does for reduced-precision inputs), which multiplies them with the
// values two tokens at a time: each pair of value rows is interleaved once per tile for all the item's queries (a
// fixed permutation of the head dimension within 128-bit lanes, undone when the output is written). Everything a
// query computes depends only on its own context, so a decode's rows are bit for bit the same in a group or alone.
// Accumulation is float32. D = 32 * V2.
template <int V2>
void decode_dpbf16(const bf16* q, const Pool& k, const Pool& v, const int64_t* tables, const int64_t* lens, bf16* out,
                   int64_t num_seqs, const Layout& lay, float scale) {
  constexpr int D = 32 * V2, A = 2 * V2;  // A float32 accumulators of 16 lanes per query
  const int64_t G = lay.num_heads / lay.num_kv_heads, KVH = lay.num_kv_heads, bs = lay.block_size;
  const std::vector<int64_t> starts = row_groups(tables, lens, num_seqs, lay);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  const uint16_t* kp = static_cast<const uint16_t*>(k.data);
  const uint16_t* vp = static_cast<const uint16_t*>(v.data);
  // With enough row groups to share out, an item is a group with every kv head, walking each block's K/V rows
  // (all heads of a token are contiguous) in address order; otherwise (a single sequence) one item per kv head.
  const int64_t NK = groups >= 8 ? KVH : 1;
  at::parallel_for(0, groups * (KVH / NK), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, m, l;
    std::vector<int64_t> qlen, qlo;
    std::vector<const uint16_t*> qrow;
    alignas(64) __m512i vi[8][A];  // the tile's value rows, interleaved in pairs of tokens
    alignas(64) uint32_t pp[8];     // a query's tile probabilities as bf16 pairs
    for (int64_t item = begin; item < end; ++item) {
      const int64_t grp = item / (KVH / NK), kh0 = item % (KVH / NK) * NK, s0 = starts[grp], R = starts[grp + 1] - s0;
      const int64_t Q = R * G, QN = Q * NK;  // query i of kv head kh0 + kk: index kk * Q + i
      const int64_t L = lens[s0 + R - 1];
      const int64_t* table = tables + s0 * lay.max_blocks;
      acc.assign(QN * D, 0.f);
      m.assign(QN, -1e30f);  // finite: the build uses -ffast-math
      l.assign(QN, 0.f);
      qlen.resize(QN);
      qlo.resize(QN);
      qrow.resize(QN);
      int64_t lo = L;
      for (int64_t i = 0; i < QN; ++i) {
        const int64_t r = i % Q / G, g = i % G, kh = kh0 + i / Q;
        qlen[i] = lens[s0 + r];
        qlo[i] = lay.start(s0 + r);
        lo = std::min(lo, qlo[i]);
        qrow[i] = reinterpret_cast<const uint16_t*>(q + (s0 + r) * lay.q_stride + (kh * G + g) * D);
      }
      for (int64_t j = lo / bs; j * bs < L; ++j)
      for (int64_t kk = 0; kk < NK; ++kk) {
        const int64_t kh = kh0 + kk, n = std::min(bs, L - j * bs);
        const int64_t row0 = table[j] * bs * KVH + kh;  // token t of the block: row row0 + t * KVH
        prefetch_block(k, v, table, j + kPrefetchBlocks, L, kh, lay, D * 2);
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const int64_t cnt = std::min<int64_t>(16, n - t0), first = j * bs + t0;  // tokens [first, first + cnt)
          if (first + cnt <= lo) continue;
          for (int64_t t = 0; t < cnt; t += 2) {
            const uint16_t* a = vp + (row0 + (t0 + t) * KVH) * D;
            const uint16_t* b = a + KVH * D;
            for (int c = 0; c < V2; ++c) {
              const __m512i x = _mm512_loadu_si512(a + 32 * c);
              const __m512i y = t + 1 < cnt ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
              vi[t / 2][2 * c] = _mm512_unpacklo_epi16(x, y);
              vi[t / 2][2 * c + 1] = _mm512_unpackhi_epi16(x, y);
            }
          }
          for (int64_t i = kk * Q; i < (kk + 1) * Q; ++i) {
            const int64_t te = std::min(cnt, qlen[i] - first), tb = std::max<int64_t>(0, qlo[i] - first);  // tokens [tb, te) seen
            if (te <= tb) continue;
            __m512bh qv[V2];
            for (int c = 0; c < V2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow[i] + 32 * c);
            __m512 dots[16];
            for (int t = 0; t < 16; ++t) {
              if (t >= te) {
                dots[t] = _mm512_setzero_ps();
                continue;
              }
              const uint16_t* kr = kp + (row0 + (t0 + t) * KVH) * D;
              __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(kr), qv[0]);
              for (int c = 1; c < V2; ++c) d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(kr + 32 * c), qv[c]);
              dots[t] = d;
            }
            const __mmask16 seen = static_cast<__mmask16>(((1u << te) - 1) & ~((1u << tb) - 1));
            const __m512 sc = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-1e30f), _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale)));
            const float mx = tile_max(m[i], sc, seen);
            const float alpha = rescale(m[i], mx);
            const __m512 p = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
            l[i] = l[i] * alpha + _mm512_reduce_add_ps(p);
            m[i] = mx;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(p));
            float* ai = &acc[i * D];
            __m512 a[A];
            for (int c = 0; c < A; ++c) a[c] = alpha == 1.f ? _mm512_loadu_ps(ai + 16 * c) : _mm512_mul_ps(_mm512_loadu_ps(ai + 16 * c), _mm512_set1_ps(alpha));
            for (int64_t t = tb / 2; t < (te + 1) / 2; ++t) {
              const __m512bh pt = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[t]));
              for (int c = 0; c < A; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)vi[t][c], pt);
            }
            for (int c = 0; c < A; ++c) _mm512_storeu_ps(ai + 16 * c, a[c]);
          }
        }
      }
      // accumulator 2c (2c + 1), lane x holds dimension 32c + 8 (x / 4) + x % 4 (+ 4): unpacklo/hi's order
      for (int64_t i = 0; i < QN; ++i) {
        const int64_t r = i % Q / G, g = i % G, kh = kh0 + i / Q;
        const float inv = 1.f / l[i];
        bf16* o = out + (s0 + r) * lay.out_stride + (kh * G + g) * D;
        const float* ai = &acc[i * D];
        for (int c = 0; c < A; ++c)
          for (int x = 0; x < 16; ++x) o[32 * (c / 2) + 8 * (x / 4) + 4 * (c % 2) + x % 4] = static_cast<bf16>(ai[16 * c + x] * inv);
      }
    }
  });
}
#endif

template <typename T, at::ScalarType kKV>
bool decode_vec_any(int64_t head_dim, const T* q, const Pool& k, const Pool& v, const int64_t* tables, const int64_t* lens,
                    T* out, int64_t num_seqs, const Layout& lay, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && kKV == at::kBFloat16) {
    switch (head_dim) {  // the sizes dpbf16_head_dim names
      case 32: decode_dpbf16<1>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
      case 64: decode_dpbf16<2>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
      case 128: decode_dpbf16<4>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
      case 256: decode_dpbf16<8>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
      default: break;
    }
  }
#endif
  switch (head_dim) {
    case 16: decode_vec<T, kKV, 1>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 32: decode_vec<T, kKV, 2>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 64: decode_vec<T, kKV, 4>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 128: decode_vec<T, kKV, 8>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 256: decode_vec<T, kKV, 16>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 576: decode_vec<T, kKV, 36>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;  // MLA: 512 latent + 64 rope
    default: return false;
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- vectorised path, AVX2: the algorithm above with 8 lanes ------------------------------------------------
#define SIEVE_DECODE_VEC 1
inline __m256 exp256(__m256 x) {  // as exp512
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

template <at::ScalarType kType>
inline __m256 load8(const void* base, int64_t at, float scale) {  // 8 consecutive elements of a K/V row as float32
  if constexpr (kType == at::kFloat) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + at);
  } else if constexpr (kType == at::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (kType == at::kHalf) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + at)));
  } else if constexpr (kType == at::kFloat8_e4m3fn) {  // e4m3 bits as float16 bits: the value / kFp8Unit, exactly
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + at)));
    const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(b, 8), 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(scale));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + at));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(scale));
  }
}

inline __m256 hsum8(const __m256 (&v)[8]) {  // lane t = sum of v[t]'s 8 lanes
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]), a2 = _mm256_hadd_ps(v[4], v[5]),
               a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit lane: partial sums of v0..3, v4..7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

template <at::ScalarType kType>
inline float row_scale(const Pool& p, int64_t row) {
  if constexpr (kType == at::kFloat8_e4m3fn) return p.scale * kFp8Unit;  // (load16 / load8 give fp8 codes / kFp8Unit)
  if constexpr (kType == at::kChar) return static_cast<float>(p.token_scales[row]);
  return 1.f;
}

template <typename T, at::ScalarType kKV, int V>  // V = head_dim / 8
void decode_vec(const T* q, const Pool& k, const Pool& v, const int64_t* tables, const int64_t* lens, T* out,
                int64_t num_seqs, const Layout& lay, float scale) {
  constexpr int D = 8 * V;
  const int64_t G = lay.num_heads / lay.num_kv_heads, KVH = lay.num_kv_heads, bs = lay.block_size, SW = bs + 8;
  const std::vector<int64_t> starts = row_groups(tables, lens, num_seqs, lay);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, groups * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, kf(bs * D), vf(bs * D), m, l;
    std::vector<int64_t> qlen, qlo;
    for (int64_t item = begin; item < end; ++item) {
      // As the AVX-512 path: the rows of a group (consecutive positions of one sequence) times the G query heads
      // of kv head kh share every K/V read; query i is row i / G, head i % G, and sees exactly its own keys, with
      // the arithmetic it would get alone (scores past its keys are padding, as past a block's end).
      const int64_t grp = item / KVH, kh = item % KVH, s0 = starts[grp], R = starts[grp + 1] - s0, Q = R * G;
      const int64_t L = lens[s0 + R - 1];
      const int64_t* table = tables + s0 * lay.max_blocks;
      scores.resize(Q * SW);
      const int64_t lo = item_queries(q, lens, lay, s0, R, G, kh, D, scale, qf, qlen, qlo, acc, m, l);
      for (int64_t j = lo / bs; j * bs < L; ++j) {
        const int64_t n = std::min(bs, L - j * bs);
        const int64_t row0 = table[j] * bs * KVH + kh;
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = row0 + t * KVH;
          const float rs = row_scale<kKV>(k, row);
          for (int i = 0; i < V; ++i) _mm256_storeu_ps(&kf[t * D + 8 * i], load8<kKV>(k.data, row * D + 8 * i, rs));
        }
        for (int64_t g = 0; g < Q; ++g) {
          const int64_t ng = std::min(n, qlen[g] - j * bs), tb = std::max<int64_t>(0, qlo[g] - j * bs);  // keys [tb, ng)
          if (ng <= tb) continue;
          __m256 qv[V];
          for (int i = 0; i < V; ++i) qv[i] = _mm256_loadu_ps(&qf[g * D + 8 * i]);
          float* sg = &scores[g * SW];
          for (int64_t t0 = 0; t0 < ng; t0 += 8) {
            __m256 dots[8];
            for (int t = 0; t < 8; ++t) {
              if (t0 + t >= ng) {
                dots[t] = _mm256_setzero_ps();
                continue;
              }
              const float* kr = &kf[(t0 + t) * D];
              __m256 d = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
              for (int i = 1; i < V; ++i) d = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(kr + 8 * i), d);
              dots[t] = d;
            }
            _mm256_storeu_ps(sg + t0, hsum8(dots));  // the row has 8 spare slots past the block
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = row0 + t * KVH;
          const float rs = row_scale<kKV>(v, row);
          for (int i = 0; i < V; ++i) _mm256_storeu_ps(&vf[t * D + 8 * i], load8<kKV>(v.data, row * D + 8 * i, rs));
        }
        for (int64_t g = 0; g < Q; ++g) {
          const int64_t ng = std::min(n, qlen[g] - j * bs), tb = std::max<int64_t>(0, qlo[g] - j * bs);
          if (ng <= tb) continue;
          float* sg = &scores[g * SW];
          float mx = m[g];
          for (int64_t t = tb; t < ng; ++t) mx = std::max(mx, sg[t]);
          const float alpha = rescale(m[g], mx);
          for (int64_t t = ng; t < ((ng + 7) / 8) * 8; ++t) sg[t] = -1e30f;  // padding: exp -> 0
          float sum = 0.f;
          for (int64_t t = 0; t < ng; t += 8) {
            const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(sg + t, p);
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, p);
            for (int64_t i = std::max<int64_t>(0, tb - t); i < std::min<int64_t>(8, ng - t); ++i) sum += tmp[i];
          }
          l[g] = l[g] * alpha + sum;
          m[g] = mx;
          __m256 a[V];
          for (int i = 0; i < V; ++i) a[i] = alpha == 1.f ? _mm256_loadu_ps(&acc[g * D + 8 * i]) : _mm256_mul_ps(_mm256_loadu_ps(&acc[g * D + 8 * i]), _mm256_set1_ps(alpha));
          for (int64_t t = tb; t < ng; ++t) {
            const __m256 p = _mm256_set1_ps(sg[t]);
            for (int i = 0; i < V; ++i) a[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(&vf[t * D + 8 * i]), a[i]);
          }
          for (int i = 0; i < V; ++i) _mm256_storeu_ps(&acc[g * D + 8 * i], a[i]);
        }
      }
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t r = i / G, g = i % G;
        const float inv = 1.f / l[i];
        for (int d = 0; d < D; ++d) out[(s0 + r) * lay.out_stride + (kh * G + g) * D + d] = static_cast<T>(acc[i * D + d] * inv);
      }
    }
  });
}

template <typename T, at::ScalarType kKV>
bool decode_vec_any(int64_t head_dim, const T* q, const Pool& k, const Pool& v, const int64_t* tables, const int64_t* lens,
                    T* out, int64_t num_seqs, const Layout& lay, float scale) {
  switch (head_dim) {
    case 16: decode_vec<T, kKV, 2>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 32: decode_vec<T, kKV, 4>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 64: decode_vec<T, kKV, 8>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    case 128: decode_vec<T, kKV, 16>(q, k, v, tables, lens, out, num_seqs, lay, scale); return true;
    default: return false;
  }
}
#endif

Pool make_pool(const torch::Tensor& pool, const c10::optional<torch::Tensor>& scale, const char* name) {
  Pool p{pool.data_ptr(), pool.scalar_type()};
  if (p.dtype == at::kFloat8_e4m3fn) {
    TORCH_CHECK(scale.has_value() && scale->numel() == 1, name, ": an fp8 pool needs its scale");
    p.scale = scale->item<float>();
  } else if (p.dtype == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kHalf && scale->is_contiguous() &&
                scale->numel() * pool.size(3) == pool.numel(), name, ": an int8 pool needs float16 scales per token and head");
    p.token_scales = scale->data_ptr<c10::Half>();
  }
  return p;
}

}  // namespace

bool decode_attention_takes_prefill(at::ScalarType q, at::ScalarType kv, int64_t head_dim) {
#if defined(__AVX512BF16__)
  return q == at::kBFloat16 && kv == at::kBFloat16 && dpbf16_head_dim(head_dim);
#else
  return false;
#endif
}

template <class T>
void paged_decode_attention_into(const T* q, int64_t q_stride, const void* k_pool, const void* v_pool, at::ScalarType kv,
                                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, const int64_t* tables, int64_t max_blocks,
                                 const int64_t* lens, int64_t num_seqs, int64_t num_heads, float scale, T* out,
                                 const c10::Half* k_scales, const c10::Half* v_scales, float k_fp8_scale, float v_fp8_scale) {
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf || kv == at::kFloat8_e4m3fn ||
              (kv == at::kChar && k_scales && v_scales),
              "the layer loop's K/V pools hold float32, bf16, float16, fp8, or int8 codes with their scales");
  const Layout lay{num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride, num_heads * head_dim};
  const Pool k{k_pool, kv, k_fp8_scale, k_scales}, v{v_pool, kv, v_fp8_scale, v_scales};
  bool done = false;
#if defined(SIEVE_DECODE_VEC)
  switch (kv) {
    case at::kFloat: done = decode_vec_any<T, at::kFloat>(head_dim, q, k, v, tables, lens, out, num_seqs, lay, scale); break;
    case at::kBFloat16: done = decode_vec_any<T, at::kBFloat16>(head_dim, q, k, v, tables, lens, out, num_seqs, lay, scale); break;
    case at::kHalf: done = decode_vec_any<T, at::kHalf>(head_dim, q, k, v, tables, lens, out, num_seqs, lay, scale); break;
    case at::kFloat8_e4m3fn: done = decode_vec_any<T, at::kFloat8_e4m3fn>(head_dim, q, k, v, tables, lens, out, num_seqs, lay, scale); break;
    default: done = decode_vec_any<T, at::kChar>(head_dim, q, k, v, tables, lens, out, num_seqs, lay, scale); break;
  }
#endif
  if (!done) decode_scalar<T>(q, k, v, tables, lens, out, num_seqs, lay, scale);
}

template void paged_decode_attention_into<bf16>(const bf16*, int64_t, const void*, const void*, at::ScalarType, int64_t, int64_t, int64_t,
                                                const int64_t*, int64_t, const int64_t*, int64_t, int64_t, float, bf16*, const c10::Half*,
                                                const c10::Half*, float, float);
template void paged_decode_attention_into<float>(const float*, int64_t, const void*, const void*, at::ScalarType, int64_t, int64_t,
                                                 int64_t, const int64_t*, int64_t, const int64_t*, int64_t, int64_t, float, float*,
                                                 const c10::Half*, const c10::Half*, float, float);

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, c10::optional<torch::Tensor> k_scale,
                                     c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> starts) {
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "inputs must be contiguous");
  const auto kv = k_pool.scalar_type();
  TORCH_CHECK(kv == v_pool.scalar_type() && (kv == q.scalar_type() || kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf ||
                                               kv == at::kFloat8_e4m3fn || kv == at::kChar),
              "K/V pools must hold float32, bf16, float16, fp8 or int8 (both the same)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), head_dim = q.size(2);
  Layout lay{q.size(1), k_pool.size(2), head_dim, k_pool.size(1), tables.size(1), q.size(1) * head_dim, q.size(1) * head_dim};
  TORCH_CHECK(k_pool.size(3) == head_dim && lay.num_heads % lay.num_kv_heads == 0, "shape mismatch");
  torch::Tensor first;
  if (starts.has_value()) {
    first = starts->contiguous();
    TORCH_CHECK(first.scalar_type() == torch::kInt64 && first.numel() == num_seqs, "starts: one int64 per row");
    lay.starts = first.data_ptr<int64_t>();
  }
  const Pool k = make_pool(k_pool, k_scale, "k"), v = make_pool(v_pool, v_scale, "v");
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    bool done = false;
#if defined(SIEVE_DECODE_VEC)
    switch (kv) {
      case at::kFloat: done = decode_vec_any<scalar_t, at::kFloat>(head_dim, qp, k, v, tp, lp, op, num_seqs, lay, s); break;
      case at::kBFloat16: done = decode_vec_any<scalar_t, at::kBFloat16>(head_dim, qp, k, v, tp, lp, op, num_seqs, lay, s); break;
      case at::kHalf: done = decode_vec_any<scalar_t, at::kHalf>(head_dim, qp, k, v, tp, lp, op, num_seqs, lay, s); break;
      case at::kFloat8_e4m3fn: done = decode_vec_any<scalar_t, at::kFloat8_e4m3fn>(head_dim, qp, k, v, tp, lp, op, num_seqs, lay, s); break;
      default: done = decode_vec_any<scalar_t, at::kChar>(head_dim, qp, k, v, tp, lp, op, num_seqs, lay, s); break;
    }
#endif
    if (!done) decode_scalar<scalar_t>(qp, k, v, tp, lp, op, num_seqs, lay, s);
  });
  return out;
}

}  // namespace sieve
