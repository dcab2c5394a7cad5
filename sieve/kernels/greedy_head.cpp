// Greedy decoding's next token from a bf16 LM head at about half its bytes, exactly (sieve/layers/greedy_head.py).
//
// A greedy row needs the argmax of its logits, not the logits. The head's int8 sketch (one scale per row, q_n) gives
// every logit to within a bound that holds for any hidden state x:
//   |logit_n - s_n x.q_n| <= |x| radius_n
// (Cauchy-Schwarz on the rounding residual w_n - s_n q_n, plus slack for float32 summation, precomputed per row), and
// the rounding of the GEMV's float32 sum to the bf16 logit the plain path returns is at most 2^-8 of it. The sketch
// (one byte a weight, against two) is read in full; every row whose upper bound reaches the best lower bound is a
// candidate, the true argmax among them; the candidates' rows are then multiplied by the same GEMV the plain path
// runs (a row's result is the same alone or among others), and the first index of their max is the plain path's
// argmax, bit for bit. On SmolLM2-135M's chat answers a row has a median of 13 candidates of 49,152 (at most ~1,000).
//
// With AVX512-BF16 the sketch is multiplied in bf16 dot products, x as it is: codes of 7 bits (|q| <= 63) become the
// bf16 numbers 192 + q exactly by one integer add (bits 0x4340 + q), and 192 sum(x) comes back out per row. That is
// the GEMV's arithmetic on half its bytes (vdpbf16ps on 32 weights), so the sketch costs no more than the GEMV at any
// row count it takes. The AVX2 build widens 8-bit codes to float32 for FMAs, as its GEMV widens bf16.
#include "kernels.h"

#if defined(SIEVE_HAS_QUANT)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sieve {

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kStep = 32;     // inputs per dot-product instruction
constexpr int kCodeMax = 63;      // |q| <= 63: 192 + q is a bf16 number
constexpr float kOffset = 192.f;  // what every code carries in the dot products
using xelem = uint16_t;           // x as bf16 bits
using wvec = __m512i;
inline wvec vcodes(const int8_t* p) {  // 32 codes -> the bf16 numbers 192 + q
  return _mm512_add_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), _mm512_set1_epi16(0x4340));
}
inline __m512 vdot(__m512 acc, wvec w, const xelem* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}
inline xelem to_x(bf16 v) {
  uint16_t b;
  std::memcpy(&b, &v, 2);
  return b;
}
#else
constexpr int64_t kStep = 8;
constexpr int kCodeMax = 127;
constexpr float kOffset = 0.f;
using xelem = float;
using wvec = __m256;
inline wvec vcodes(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 vdot(__m256 acc, wvec w, const xelem* x) { return _mm256_fmadd_ps(w, _mm256_loadu_ps(x), acc); }
inline xelem to_x(bf16 v) { return static_cast<float>(v); }
#endif

#if defined(__AVX512F__)
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int64_t kPrefetch = 512;  // bytes ahead in each read stream

// One x row's running best lower bound, and the rows (with their sketch logits) whose upper bound reached it when
// they were seen: a superset of the final candidates, since the best only grows.
struct Bounds {
  float best = -3.0e38f;
  std::vector<std::pair<int64_t, float>> rows;
};

struct Sketch {
  const int8_t* q;
  const float *scale, *radius;
  int64_t Kp;
  const xelem* x;                    // [M, Kp], zero padded
  const float *xnorm, *offset, *x1;  // per x row: |x|, kOffset sum(x), sum |x|
  // |logit - sketch logit| for row n and x row m, before the bf16 rounding: the rounding residual's share, plus the
  // float32 error of summing kOffset + q against x (relative 2^-14 for K <= 4096, with margin)
  float bound(int64_t n, int64_t m) const { return xnorm[m] * radius[n] + x1[m] * scale[n] * ((kOffset + kCodeMax) * 0x1p-14f); }
};

// The radius of logit n's interval for bound b, widened by the bf16 rounding of a logit of magnitude up to |a| + b
// (2^-8 relative), and a little more for the float32 arithmetic of the bound itself.
inline float interval(float a, float b) { return (b + (std::fabs(a) + b) * (1.f / 256.f)) * 1.0001f + 1e-30f; }

// acc[j][m][p]: the dot products of sketch row r[j] with x row m over the steps k with (k / kStep) % P == p
template <int M, int P, int R>
inline void sketch_rows(const int8_t* const (&r)[R], const xelem* x, int64_t Kp, vec (&acc)[R][M][P]) {
  for (int j = 0; j < R; ++j)
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < P; ++p) acc[j][m][p] = vzero();
  int64_t k = 0;
  for (; k + P * kStep <= Kp; k += P * kStep) {
    for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(r[j] + k + kPrefetch), _MM_HINT_T0);
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < R; ++j) {
        const wvec w = vcodes(r[j] + k + p * kStep);
        for (int m = 0; m < M; ++m) acc[j][m][p] = vdot(acc[j][m][p], w, x + m * Kp + k + p * kStep);
      }
  }
  for (; k < Kp; k += kStep)
    for (int j = 0; j < R; ++j) {
      const wvec w = vcodes(r[j] + k);
      for (int m = 0; m < M; ++m) acc[j][m][0] = vdot(acc[j][m][0], w, x + m * Kp + k);
    }
}

// Rows [begin, end) for M x rows, two rows at a time (two read streams, as the GEMV walks its share); with few x rows
// each sum runs in P = 4 / M interleaved parts, so that the dot products' latency is not the bound.
template <int M>
void sketch(const Sketch& sk, int64_t begin, int64_t end, Bounds* bounds) {
  constexpr int P = M >= 4 ? 1 : 4 / M;
  auto finish = [&](int64_t n, const vec (&acc)[M][P]) {
    for (int m = 0; m < M; ++m) {
      vec t = acc[m][0];
      for (int p = 1; p < P; ++p) t = vadd(t, acc[m][p]);
      const float a = sk.scale[n] * (vsum(t) - sk.offset[m]);
      const float r = interval(a, sk.bound(n, m));
      Bounds& bd = bounds[m];
      if (a - r > bd.best) bd.best = a - r;
      if (a + r >= bd.best) bd.rows.emplace_back(n, a);
    }
  };
  const int64_t half = (end - begin) / 2, Kp = sk.Kp;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t n0 = begin + i, n1 = begin + half + i;
    vec acc[2][M][P];
    sketch_rows<M, P, 2>({sk.q + n0 * Kp, sk.q + n1 * Kp}, sk.x, Kp, acc);
    finish(n0, acc[0]);
    finish(n1, acc[1]);
  }
  for (int64_t n = begin + 2 * half; n < end; ++n) {
    vec acc[1][M][P];
    sketch_rows<M, P, 1>({sk.q + n * Kp}, sk.x, Kp, acc);
    finish(n, acc[0]);
  }
}

void sketch_any(const Sketch& sk, int64_t M, int64_t begin, int64_t end, Bounds* bounds) {
  switch (M) {
    case 1: return sketch<1>(sk, begin, end, bounds);
    case 2: return sketch<2>(sk, begin, end, bounds);
    case 3: return sketch<3>(sk, begin, end, bounds);
    case 4: return sketch<4>(sk, begin, end, bounds);
#if defined(__AVX512BF16__)
    case 5: return sketch<5>(sk, begin, end, bounds);
    case 6: return sketch<6>(sk, begin, end, bounds);
    case 7: return sketch<7>(sk, begin, end, bounds);
    case 8: return sketch<8>(sk, begin, end, bounds);
#endif
    default: TORCH_CHECK(false, "greedy_head: ", M, " rows");
  }
}

}  // namespace

int64_t greedy_head_code_max() { return kCodeMax; }

std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor w, torch::Tensor codes, torch::Tensor scale,
                                                     torch::Tensor radius) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 && x.size(0) <= kGemvMaxRows,
              "greedy_head takes bf16 [M, K] hidden states, 1 <= M <= ", kGemvMaxRows);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) == K && w.is_contiguous(), "greedy_head: a bf16 [N, K] head");
  TORCH_CHECK(K <= 4096, "greedy_head: the bounds' summation slack covers K <= 4096, got ", K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(0) == N && codes.size(1) % 32 == 0 &&
                  codes.size(1) >= K && codes.is_contiguous(),
              "greedy_head: int8 codes [N, Kp], Kp a multiple of 32 (zero padded)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && radius.scalar_type() == at::kFloat && scale.numel() == N && radius.numel() == N &&
                  scale.is_contiguous() && radius.is_contiguous(),
              "greedy_head: float32 [N] scales and radii");
  const int64_t Kp = codes.size(1);
  auto xc = x.contiguous();
  const bf16* xp = xc.data_ptr<bf16>();
  auto ids = torch::full({M}, -1, torch::kLong);
  auto counts = torch::zeros({M}, torch::kLong);
  int64_t *idp = ids.data_ptr<int64_t>(), *cp = counts.data_ptr<int64_t>();
  // x zero padded to Kp, and its norms and sum (in double, then rounded up); a row that is not finite has no bound,
  // and gets -1 (the caller computes the logits)
  std::vector<xelem> xs(M * Kp, xelem{});
  std::vector<float> xnorm(M), offset(M), x1(M);
  std::vector<bool> finite(M, true);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0, sum = 0, l1 = 0;
    for (int64_t k = 0; k < K; ++k) {
      uint16_t bits;
      std::memcpy(&bits, xp + m * K + k, 2);
      if ((bits & 0x7F80) == 0x7F80) finite[m] = false;  // inf or NaN (tested on the bits: the build uses -ffast-math)
      xs[m * Kp + k] = to_x(xp[m * K + k]);
      const double v = static_cast<float>(xp[m * K + k]);
      ss += v * v;
      sum += v;
      l1 += std::fabs(v);
    }
    xnorm[m] = static_cast<float>(std::sqrt(ss) * (1 + 1e-6));
    offset[m] = static_cast<float>(kOffset * sum);
    x1[m] = static_cast<float>(l1 * (1 + 1e-6));
  }
  const Sketch sk{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), radius.data_ptr<float>(), Kp, xs.data(), xnorm.data(),
                  offset.data(), x1.data()};
  const int64_t chunks = std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::vector<Bounds>> per_chunk(chunks, std::vector<Bounds>(M));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) sketch_any(sk, M, N * c / chunks, N * (c + 1) / chunks, per_chunk[c].data());
  });
  const bf16* wp = w.data_ptr<bf16>();
  std::vector<bf16> rows, y;
  std::vector<int64_t> cand;
  for (int64_t m = 0; m < M; ++m) {
    if (!finite[m]) continue;
    float best = -3.0e38f;
    for (const auto& pc : per_chunk) best = std::max(best, pc[m].best);
    cand.clear();
    for (const auto& pc : per_chunk)
      for (const auto& [n, an] : pc[m].rows)
        if (an + interval(an, sk.bound(n, m)) >= best) cand.push_back(n);
    std::sort(cand.begin(), cand.end());
    const int64_t C = static_cast<int64_t>(cand.size());
    TORCH_CHECK(C > 0, "greedy_head: no candidate row");  // the row of the best lower bound always is one
    cp[m] = C;
    if (C == 1) {
      idp[m] = cand[0];
      continue;
    }
    rows.resize(C * K);
    y.resize(C);
    for (int64_t i = 0; i < C; ++i) std::memcpy(rows.data() + i * K, wp + cand[i] * K, K * sizeof(bf16));
    gemv_bf16_into(xp + m * K, 1, K, rows.data(), C, nullptr, y.data());  // the plain path's arithmetic for these rows
    int64_t arg = 0;
    for (int64_t i = 1; i < C; ++i)
      if (static_cast<float>(y[i]) > static_cast<float>(y[arg])) arg = i;  // the first index of the max
    idp[m] = cand[arg];
  }
  return {ids, counts};
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// A GGUF Q8_0 head (int8 codes, a float16 scale per 32 inputs, the blocked layout of qmatmul.cpp) for float32 hidden
// states. The plain path rounds x to bf16 (xb) and multiplies the codes in bf16 dot products. Here xb is quantized
// per block b of 32 inputs to int8 (xb = d_b q + r), and vpdpbusd multiplies the file's own codes by q (one byte a
// weight, the same bytes the plain path reads, in a quarter of the instructions: 4 products a lane). With W_n the
// row's dequantized weights, every logit is within
//   |plain_n - A_n| <= |W_n| (|r| + 2^-10 (|xb| + |d q|)) + 1e-30
// of the sketch A_n (Cauchy-Schwarz on r; float32 summation of at most 2^12 terms on either side; flushed
// subnormals), so the rows whose interval reaches the best lower bound hold the argmax, and their 16-row blocks are
// multiplied by qmatmul_q8_into, the plain path's own arithmetic (a row's result does not depend on the rows beside
// it), bit for bit.
namespace {

// MR rows of xq against NB blocks of 16 head rows, all groups: A [M, N] float32
template <int MR, int NB>
void q8_sketch_tile(const int8_t* xq, const float* d, const int32_t* qsum, int64_t K2, const uint8_t* w, const c10::Half* gscale,
                    int64_t group, int64_t m0, const int64_t* blk, int64_t N, float* A) {
  const int64_t G = K2 / group, nb = K2 / 32, loads = group / 4;  // 64 bytes = 4 inputs x 16 rows
  // word 2r of a 64-byte load's result: row r's inputs (2p, 2p + 1) from the first pair-vector, word 2r + 1 its
  // (2p + 2, 2p + 3) from the second: one 32-bit lane per row, in order
  alignas(64) int16_t idx[32];
  for (int r = 0; r < 16; ++r) idx[2 * r] = static_cast<int16_t>(r), idx[2 * r + 1] = static_cast<int16_t>(16 + r);
  const __m512i perm = _mm512_load_si512(idx), flip = _mm512_set1_epi8(static_cast<char>(0x80));  // codes + 128: unsigned
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = w + blk[j] * (K2 / 2) * 32;
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i sum[MR][NB];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB; ++j) sum[m][j] = _mm512_setzero_si512();
    for (int64_t l = g * loads; l < (g + 1) * loads; ++l) {
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(base[j] + l * 64 + 512), _MM_HINT_T0);
        const __m512i v = _mm512_xor_si512(_mm512_permutexvar_epi16(perm, _mm512_loadu_si512(base[j] + l * 64)), flip);
        for (int m = 0; m < MR; ++m) {
          int32_t quad;
          std::memcpy(&quad, xq + (m0 + m) * K2 + 4 * l, 4);
          sum[m][j] = _mm512_dpbusd_epi32(sum[m][j], v, _mm512_set1_epi32(quad));
        }
      }
    }
    // group g spans activation blocks; the codes' +128 comes back out as 128 sum(q) per block
    for (int j = 0; j < NB; ++j) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gscale + (blk[j] * G + g) * 16)));
      for (int m = 0; m < MR; ++m) {
        const int64_t b = g;  // a group is one activation block (group == 32, checked by the caller)
        const __m512i isum = _mm512_sub_epi32(sum[m][j], _mm512_set1_epi32(128 * qsum[(m0 + m) * nb + b]));
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(d[(m0 + m) * nb + b])), acc[m][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = blk[j] * 16, cnt = std::min<int64_t>(16, N - n0);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(A + (m0 + m) * N + n0, static_cast<__mmask16>((1u << cnt) - 1), acc[m][j]);
  }
}

// From how many rows the sketch runs on AMX-INT8 tiles (below) where the CPU has them and Linux grants them: the same A
// either way, so this is speed alone. On the Emerald Rapids host (SmolLM2's 49,152-row Q8_0 head, ms against vpdpbusd):
// 7 rows 1.30 / 1.17, 9 rows 1.37 / 1.44, 16 rows 1.97 / 2.27, 32 rows 3.45 / 4.34 (docs/design-notes.md, issue 15,
// twenty-first part): a tile product costs about as much at one row as at 16.
constexpr int64_t kHeadAmxFromRows = 9;
constexpr int64_t kHeadMaxRows = 64;  // A [M, N] float32: 12.6 MB for SmolLM2 at 64 rows
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// The same sketch on AMX-INT8 tiles: for one group of 32 inputs and 16 head rows, tdpbssd multiplies the signed codes
// of up to 16 x rows (A: 32 bytes a row, where quantize_rows put them) by the file's signed codes (B: 8 rows of 64
// bytes, a 32-bit lane holding one head row's 4 consecutive inputs: the 64-byte loads above, permuted as above, with
// no +128), and sums exactly in 32 bits. So C is q8_sketch_tile's sum(q + 128) x - 128 qsum to the bit, and each group
// ends with that kernel's FMA: the same A, whichever of the two ran. What the tiles save is vpdpbusd's per-row work
// (one instruction per x row and 4 inputs of 16 head rows, against one tile product for 16 rows and 32 inputs).
// Software-pipelined as qmatmul_q8act.cpp's tiles (int8_tile_pipeline, kernels.h).
constexpr int64_t kHeadAmxRows = 16;
constexpr int kHeadAmxBlocks = 3;  // tiles: 0 = A, 1 .. 3 = B of 3 blocks of head rows, 4 .. 6 = their C

// All M rows of xq ([Mp, K2], Mp a multiple of 16 where M > 16) against NB blocks of 16 head rows: A [M, N] float32;
// cbuf [2][NB][Mp][16]
template <int NB>
void q8_sketch_amx(const int8_t* xq, const float* d, int64_t M, int64_t K2, const uint8_t* w, const c10::Half* gscale, int64_t group,
                   const int64_t (&blk)[NB], int64_t N, float* A, int32_t* cbuf) {
  const int64_t G = K2 / group, loads = group / 4, nb = K2 / 32, chunks = (M + kHeadAmxRows - 1) / kHeadAmxRows;
  const int64_t Mp = chunks * kHeadAmxRows;
  alignas(64) int16_t idx[32];
  for (int r = 0; r < 16; ++r) idx[2 * r] = static_cast<int16_t>(r), idx[2 * r + 1] = static_cast<int16_t>(16 + r);
  const __m512i perm = _mm512_load_si512(idx);
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = w + blk[j] * (K2 / 2) * 32;
  __m512 acc[kHeadMaxRows][NB];  // up to 64 rows (checked by the caller)
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  auto decode = [&](int64_t g, uint8_t (&bt)[NB][8 * 64]) {
    for (int j = 0; j < NB; ++j)
      for (int64_t l = 0; l < loads; ++l) {
        const uint8_t* p = base[j] + (g * loads + l) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
        _mm512_store_si512(bt[j] + l * 64, _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(p)));
      }
  };
  auto end_group = [&](int64_t g, const int32_t* c) {  // q8_sketch_tile's float step for group g (one activation block)
    __m512 sc[NB];
    for (int j = 0; j < NB; ++j)
      sc[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gscale + (blk[j] * G + g) * 16)));
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < NB; ++j) {
        const __m512i isum = _mm512_load_si512(c + (j * Mp + m) * 16);
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc[j], _mm512_set1_ps(d[m * nb + g])), acc[m][j]);
      }
  };
  int8_tile_pipeline<NB, true>(xq, K2, M, G, cbuf, decode, end_group);
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = blk[j] * 16, cnt = std::min<int64_t>(16, N - n0);
    for (int64_t m = 0; m < M; ++m) _mm512_mask_storeu_ps(A + m * N + n0, static_cast<__mmask16>((1u << cnt) - 1), acc[m][j]);
  }
}

void q8_sketch_on_tiles(const Q8Rows& X, int64_t M, int64_t K2, const uint8_t* w, int64_t blocks, const c10::Half* gscale,
                        int64_t group, int64_t N, float* A) {
  const int8_t* xq = X.q.data();
  std::vector<int8_t> padded;
  xq = whole_tiles(xq, M, K2, padded);  // whole tiles of rows past the first
  const int64_t Mp = (M + kHeadAmxRows - 1) / kHeadAmxRows * kHeadAmxRows;
  // as sweep (kernels.h): a thread walks kHeadAmxBlocks parts of its share side by side, one read stream each
  at::parallel_for(0, blocks, kHeadAmxBlocks, [&](int64_t b0, int64_t b1) {
    load_int8_tiles(std::min(M, kHeadAmxRows));
    std::vector<__m512i> cbuf(2 * kHeadAmxBlocks * Mp);  // 16 sums a row (aligned as __m512i)
    int32_t* c = reinterpret_cast<int32_t*>(cbuf.data());
    const int64_t part = (b1 - b0) / kHeadAmxBlocks;
    for (int64_t i = 0; i < part; ++i) {
      int64_t blk[kHeadAmxBlocks];
      for (int j = 0; j < kHeadAmxBlocks; ++j) blk[j] = b0 + j * part + i;
      q8_sketch_amx<kHeadAmxBlocks>(xq, X.d.data(), M, K2, w, gscale, group, blk, N, A, c);
    }
    for (int64_t b = b0 + kHeadAmxBlocks * part; b < b1; ++b) {
      const int64_t one[1] = {b};
      q8_sketch_amx<1>(xq, X.d.data(), M, K2, w, gscale, group, one, N, A, c);
    }
    _tile_release();
  });
}
constexpr bool kHeadHasAmx = true;
#else
void q8_sketch_on_tiles(const Q8Rows&, int64_t, int64_t, const uint8_t*, int64_t, const c10::Half*, int64_t, int64_t, float*) {}
constexpr bool kHeadHasAmx = false;
#endif

std::atomic<int64_t> head_amx_rows{kHeadAmxFromRows};
bool head_on_tiles(int64_t M) { return kHeadHasAmx && M >= head_amx_rows.load(std::memory_order_relaxed) && amx_permitted(); }

// A row's bounds against every head row n, 8 at a time in double: the best lower bound a_n - (|W_n| R + 1e-30), then
// the rows whose upper bound a_n + |W_n| R + 1e-30 reaches it, in order (every row the argmax can be, ties included)
inline double best_lower_bound(const float* a, const float* wn, int64_t N, double R) {
  const __m512d r = _mm512_set1_pd(R), eps = _mm512_set1_pd(1e-30);
  __m512d best = _mm512_set1_pd(-1e300);
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m512d av = _mm512_cvtps_pd(_mm256_loadu_ps(a + n)), w = _mm512_cvtps_pd(_mm256_loadu_ps(wn + n));
    best = _mm512_max_pd(best, _mm512_sub_pd(av, _mm512_add_pd(_mm512_mul_pd(w, r), eps)));
  }
  double b = _mm512_reduce_max_pd(best);
  for (; n < N; ++n) b = std::max(b, static_cast<double>(a[n]) - (wn[n] * R + 1e-30));
  return b;
}
inline void rows_reaching(const float* a, const float* wn, int64_t N, double R, double best, std::vector<int64_t>& rows) {
  const __m512d r = _mm512_set1_pd(R), eps = _mm512_set1_pd(1e-30), b = _mm512_set1_pd(best);
  rows.clear();
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m512d av = _mm512_cvtps_pd(_mm256_loadu_ps(a + n)), w = _mm512_cvtps_pd(_mm256_loadu_ps(wn + n));
    for (unsigned mask = _mm512_cmp_pd_mask(_mm512_add_pd(av, _mm512_add_pd(_mm512_mul_pd(w, r), eps)), b, _CMP_GE_OQ); mask;
         mask &= mask - 1)
      rows.push_back(n + __builtin_ctz(mask));
  }
  for (; n < N; ++n)
    if (static_cast<double>(a[n]) + (wn[n] * R + 1e-30) >= best) rows.push_back(n);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> greedy_head_q8(torch::Tensor x, torch::Tensor w, torch::Tensor gscale, int64_t group,
                                                        int64_t N, torch::Tensor wnorm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(0) <= greedy_head_q8_max_rows(),
              "greedy_head_q8 takes float32 [M, K] hidden states, 1 <= M <= ", greedy_head_q8_max_rows());
  TORCH_CHECK(group == 32, "greedy_head_q8: Q8_0 groups of 32 inputs, got ", group);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == 32 && w.is_contiguous() && N <= w.size(0) * 16,
              "greedy_head_q8: blocked int8 codes [N/16, K/2, 32]");
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0), K2 = w.size(1) * 2, G = K2 / group, nb = K2 / 32;
  TORCH_CHECK(K <= K2 && K2 % 32 == 0 && K2 <= 4096, "greedy_head_q8: K <= 4096 in blocks of 32 (the bounds' summation slack)");
  TORCH_CHECK(gscale.scalar_type() == at::kHalf && gscale.numel() == blocks * G * 16 && gscale.is_contiguous(),
              "greedy_head_q8: float16 group scales [N/16, G, 16]");
  TORCH_CHECK(wnorm.scalar_type() == at::kFloat && wnorm.numel() == N && wnorm.is_contiguous(), "greedy_head_q8: float32 [N] row norms");
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  auto ids = torch::full({M}, -1, torch::kLong);
  auto counts = torch::zeros({M}, torch::kLong);
  int64_t *idp = ids.data_ptr<int64_t>(), *cp = counts.data_ptr<int64_t>();
  // xb = bf16(x) as the plain kernel rounds it, quantized per 32 inputs as the int8-activation kernels quantize theirs
  // (quantize_rows); a row that is not finite has no bound: it stays zero and gets id -1 (the caller computes the logits)
  std::vector<bf16> xb(M * K, bf16(0.f));
  std::vector<bool> finite(M, true);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      uint32_t bits;
      std::memcpy(&bits, xp + m * K + k, 4);
      if ((bits & 0x7F800000u) == 0x7F800000u) finite[m] = false;  // inf or NaN (the build uses -ffast-math)
    }
    if (finite[m])
      for (int64_t k = 0; k < K; ++k) xb[m * K + k] = bf16(xp[m * K + k]);  // round to nearest even, as vcvtneps2bf16
  }
  const Q8Rows X = quantize_rows(xb.data(), false, M, K, K2, false);
  // per block the codes' sum (the +128 of the unsigned codes comes back out as 128 sum(q)); per row the bound's radius
  // |r| + 2^-10 (|xb| + |d q|), in double, rounded up
  std::vector<int32_t> qsum(M * nb, 0);
  std::vector<double> radius(M, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    double rr = 0, xx = 0, qq = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const double db = X.d[m * nb + b];
      for (int64_t i = 0; i < 32; ++i) {
        const int64_t k = b * 32 + i;
        const int q = X.q[m * K2 + k];
        const double v = k < K ? static_cast<double>(static_cast<float>(xb[m * K + k])) : 0.0, dq = db * q, r = v - dq;
        qsum[m * nb + b] += q;
        rr += r * r, xx += v * v, qq += dq * dq;
      }
    }
    radius[m] = (std::sqrt(rr) + std::ldexp(std::sqrt(xx) + std::sqrt(qq), -10)) * (1 + std::ldexp(1.0, -16));
  }
  std::vector<float> A(M * N);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = gscale.data_ptr<c10::Half>();
  // up to 4 rows against two blocks side by side (two read streams); above, two blocks' sums would not fit in the
  // registers (kernels.h: threads split the blocks)
  auto tile = [&]<int MR, int B>(int64_t m0, const int64_t (&blk)[B]) {
    q8_sketch_tile<MR, B>(X.q.data(), X.d.data(), qsum.data(), K2, wp, sp, group, m0, blk, N, A.data());
  };
  if (head_on_tiles(M)) q8_sketch_on_tiles(X, M, K2, wp, blocks, sp, group, N, A.data());
  else if (M <= 4) sweep<4, 2>(M, blocks, tile);
  else sweep<8, 1>(M, blocks, tile);
  const float* wn = wnorm.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m_begin, int64_t m_end) {  // each row's candidates on its own
    std::vector<int64_t> cand;
    float y[16];
    for (int64_t m = m_begin; m < m_end; ++m) {
      if (!finite[m]) continue;
      const float* a = A.data() + m * N;
      const double R = radius[m];
      const double best = best_lower_bound(a, wn, N, R);
      rows_reaching(a, wn, N, R, best, cand);
      TORCH_CHECK(!cand.empty(), "greedy_head_q8: no candidate row");
      cp[m] = static_cast<int64_t>(cand.size());
      int64_t arg = -1;
      float top = 0.f;
      for (size_t c = 0; c < cand.size();) {  // the plain path's arithmetic on the candidates' blocks (x row m alone)
        const int64_t blk = cand[c] / 16, n0 = blk * 16, cnt = std::min<int64_t>(16, N - n0);
        qmatmul_q8_into(xp + m * K, true, 1, K, wp + blk * (K2 / 2) * 32, 1, K2, false, nullptr, sp + blk * G * 16, group, nullptr, cnt, y);
        for (; c < cand.size() && cand[c] / 16 == blk; ++c)  // the first index of the max (candidates in order)
          if (arg < 0 || y[cand[c] - n0] > top) arg = cand[c], top = y[cand[c] - n0];
      }
      idp[m] = arg;
    }
  });
  return {ids, counts};
}

int64_t greedy_head_q8_max_rows() { return kHeadMaxRows; }
int64_t greedy_head_q8_amx_rows() { return head_amx_rows.load(); }
int64_t set_greedy_head_q8_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1 && rows <= kHeadMaxRows + 1, "greedy head amx rows: 1 to ", kHeadMaxRows + 1, ", not ", rows);
  return head_amx_rows.exchange(rows);
}
#endif

}  // namespace sieve

#endif
