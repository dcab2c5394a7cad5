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
// argmax, bit for bit. On SmolLM2-135M's chat answers a step has 1-5 candidates (at most 66) of 49,152 rows.
#include "kernels.h"

#if defined(SIEVE_HAS_QUANT)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sieve {

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vcodes(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
#else
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vcodes(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#ifndef SIEVE_GH_PREFETCH
#define SIEVE_GH_PREFETCH 512
#endif
constexpr int64_t kPrefetch = SIEVE_GH_PREFETCH;

struct Bounds {  // one x row's running best lower bound and the rows whose upper bound reached it when seen
  float best = -3.0e38f;
  std::vector<int64_t> rows;
};

// The radius of logit n's interval: |x| radius_n, widened by the bf16 rounding of a logit of magnitude up to |a| + b
// (2^-8 relative), and by a little more for the float32 arithmetic of the bound itself.
inline float interval(float a, float b) { return (b + (std::fabs(a) + b) * (1.f / 256.f)) * 1.0001f + 1e-30f; }

// acc[j][m][p]: the sums of sketch row r[j] times x row m, over the inputs k with (k / kLanes) % P == p
template <int M, int P, int R>
inline void sketch_rows(const int8_t* const (&r)[R], const float* xf, int64_t Kp, vec (&acc)[R][M][P]) {
  for (int j = 0; j < R; ++j)
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < P; ++p) acc[j][m][p] = vzero();
  int64_t k = 0;
  for (; k + P * kLanes <= Kp; k += P * kLanes) {
    for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(r[j] + k + kPrefetch), _MM_HINT_T0);
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < R; ++j) {
        const vec w = vcodes(r[j] + k + p * kLanes);
        for (int m = 0; m < M; ++m) acc[j][m][p] = vfma(w, vload(xf + m * Kp + k + p * kLanes), acc[j][m][p]);
      }
  }
  for (; k < Kp; k += kLanes)
    for (int j = 0; j < R; ++j) {
      const vec w = vcodes(r[j] + k);
      for (int m = 0; m < M; ++m) acc[j][m][0] = vfma(w, vload(xf + m * Kp + k), acc[j][m][0]);
    }
}

// Sketch logits of rows [begin, end) for M x rows, two rows at a time (two read streams, as the GEMV walks its share);
// with few x rows each sum runs in P = 4 / M interleaved parts, so that the FMA latency is not the bound.
template <int M>
void sketch(const float* xf, int64_t Kp, const int8_t* q, const float* scale, const float* radius, const float* xnorm,
            int64_t begin, int64_t end, int64_t N, float* a_out, Bounds* bounds) {
  constexpr int P = M >= 4 ? 1 : 4 / M;
  auto finish = [&](int64_t n, const vec (&acc)[M][P]) {
    for (int m = 0; m < M; ++m) {
      vec t = acc[m][0];
      for (int p = 1; p < P; ++p) t = vadd(t, acc[m][p]);
      const float a = scale[n] * vsum(t);
      a_out[m * N + n] = a;
      const float r = interval(a, xnorm[m] * radius[n]);
      Bounds& bd = bounds[m];
      if (a - r > bd.best) bd.best = a - r;
      if (a + r >= bd.best) bd.rows.push_back(n);
    }
  };
  const int64_t half = (end - begin) / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t n0 = begin + i, n1 = begin + half + i;
    vec acc[2][M][P];
    sketch_rows<M, P, 2>({q + n0 * Kp, q + n1 * Kp}, xf, Kp, acc);
    finish(n0, acc[0]);
    finish(n1, acc[1]);
  }
  for (int64_t n = begin + 2 * half; n < end; ++n) {
    vec acc[1][M][P];
    sketch_rows<M, P, 1>({q + n * Kp}, xf, Kp, acc);
    finish(n, acc[0]);
  }
}

template <int M>
void sketch_chunks(const float* xf, int64_t Kp, const int8_t* q, const float* scale, const float* radius, const float* xnorm,
                   int64_t N, float* a_out, std::vector<std::vector<Bounds>>& per_chunk) {
  const int64_t chunks = static_cast<int64_t>(per_chunk.size());
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      sketch<M>(xf, Kp, q, scale, radius, xnorm, N * c / chunks, N * (c + 1) / chunks, N, a_out, per_chunk[c].data());
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor w, torch::Tensor codes, torch::Tensor scale,
                                                     torch::Tensor radius) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 && x.size(0) <= kGemvMaxRows,
              "greedy_head takes bf16 [M, K] hidden states, 1 <= M <= ", kGemvMaxRows);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) == K && w.is_contiguous(), "greedy_head: a bf16 [N, K] head");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(0) == N && codes.size(1) % kLanes == 0 &&
                  codes.size(1) >= K && codes.is_contiguous(),
              "greedy_head: int8 codes [N, Kp], Kp a multiple of ", kLanes, " (zero padded)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && radius.scalar_type() == at::kFloat && scale.numel() == N && radius.numel() == N &&
                  scale.is_contiguous() && radius.is_contiguous(),
              "greedy_head: float32 [N] scales and radii");
  const int64_t Kp = codes.size(1);
  auto xc = x.contiguous();
  const bf16* xp = xc.data_ptr<bf16>();
  auto ids = torch::full({M}, -1, torch::kLong);
  auto counts = torch::zeros({M}, torch::kLong);
  int64_t *idp = ids.data_ptr<int64_t>(), *cp = counts.data_ptr<int64_t>();
  // x as float32, zero padded to Kp, and its norm (computed in double: one rounding); a row that is not finite has
  // no bound, and gets -1 (the caller takes the plain path)
  std::vector<float> xf(M * Kp, 0.f), xnorm(M);
  std::vector<bool> finite(M, true);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) {
      uint16_t bits;
      std::memcpy(&bits, xp + m * K + k, 2);
      if ((bits & 0x7F80) == 0x7F80) finite[m] = false;  // inf or NaN (tested on the bits: the build uses -ffast-math)
      const float v = static_cast<float>(xp[m * K + k]);
      xf[m * Kp + k] = v;
      ss += static_cast<double>(v) * v;
    }
    xnorm[m] = static_cast<float>(std::sqrt(ss) * (1 + 1e-6));
  }
  std::vector<float> a(M * N);
  const int64_t chunks = std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::vector<Bounds>> per_chunk(chunks, std::vector<Bounds>(M));
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *rp = radius.data_ptr<float>();
  switch (M) {
    case 1: sketch_chunks<1>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
    case 2: sketch_chunks<2>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
    case 3: sketch_chunks<3>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
    case 4: sketch_chunks<4>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
#if defined(__AVX512F__)
    case 5: sketch_chunks<5>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
    case 6: sketch_chunks<6>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
    case 7: sketch_chunks<7>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
    case 8: sketch_chunks<8>(xf.data(), Kp, qp, sp, rp, xnorm.data(), N, a.data(), per_chunk); break;
#endif
    default: TORCH_CHECK(false, "greedy_head: ", M, " rows");
  }
  const bf16* wp = w.data_ptr<bf16>();
  std::vector<bf16> rows, y;
  std::vector<int64_t> cand;
  for (int64_t m = 0; m < M; ++m) {
    if (!finite[m]) continue;
    float best = -3.0e38f;
    for (const auto& pc : per_chunk) best = std::max(best, pc[m].best);
    cand.clear();
    for (const auto& pc : per_chunk)
      for (int64_t n : pc[m].rows) {
        const float an = a[m * N + n];
        if (an + interval(an, xnorm[m] * rp[n]) >= best) cand.push_back(n);
      }
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

}  // namespace sieve

#endif
