// Native CPU kernels. (1) Paged decode attention: one query token per sequence, K/V read in place from the
// block pool through each sequence's block table (no gather, no padding to the longest context).
//
//   q            [num_seqs, num_heads, head_dim]                  (float32 | bfloat16 | float16)
//   k_pool/v_pool[num_blocks, block_size, num_kv_heads, head_dim] (same dtype as q)
//   block_tables [num_seqs, max_blocks] int64
//   context_lens [num_seqs] int64
//   returns      [num_seqs, num_heads, head_dim]
//
// Work is split over (sequence, kv head); each item scores its G = num_heads / num_kv_heads query
// heads against the sequence's keys in float32, takes a softmax, and accumulates V in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <math.h>

#include <cstring>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

template <typename T>
void decode_kernel(const T* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
                   T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t G = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t token_stride = num_kv_heads * D;       // between tokens of one block
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kf(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kh = item % num_kv_heads;
      const int64_t L = lens[s];
      const int64_t* table = tables + s * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f32(q[(s * num_heads + kh * G + g) * D + d]) * scale;
      scores.assign(G * L, 0.f);
      // scores[g, t] = q_g . k_t
      for (int64_t t = 0; t < L; ++t) {
        const T* kp = k_pool + table[t / block_size] * block_stride + (t % block_size) * token_stride + kh * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = to_f32(kp[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
          scores[g * L + t] = dot;
        }
      }
      // softmax over t, per head
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = sg[t] > mx ? sg[t] : mx;
        // expf in its own simd loop so it maps to glibc's vector expf (libmvec)
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) sg[t] = expf(sg[t] - mx);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) sum += sg[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vp = v_pool + table[t / block_size] * block_stride + (t % block_size) * token_stride + kh * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = to_f32(vp[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) out[(s * num_heads + kh * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_pool.size(1), num_kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == head_dim && num_heads % num_kv_heads == 0, "shape mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs,
                            num_heads, num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// ---- small-M GEMV: y[M, N] = x[M, K] . W[N, K]^T (+ bias), bfloat16, float32 accumulation --------------
// Decode reads every weight once per step, so this is a read stream. Measured on this class of CPU,
// one read stream per core reaches ~21 GB/s and two reach ~27, so each thread walks two row ranges
// at once (rows i and i + half of its share).
#if defined(__AVX512BF16__)
constexpr int64_t kGemvMaxRows = 4;

template <int64_t M>  // rows of x, known at compile time so the accumulators stay in registers
inline void gemv_rows(const uint16_t* x, int64_t K, const uint16_t* r0, const uint16_t* r1,
                      float out0[kGemvMaxRows], float out1[kGemvMaxRows]) {
  __m512 a0[kGemvMaxRows], a1[kGemvMaxRows];
  for (int64_t m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, r0 + k);
    const __m512bh w1 = r1 ? (__m512bh)_mm512_maskz_loadu_epi16(mask, r1 + k) : w0;
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      a0[m] = _mm512_dpbf16_ps(a0[m], w0, xv);
      if (r1) a1[m] = _mm512_dpbf16_ps(a1[m], w1, xv);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    out0[m] = _mm512_reduce_add_ps(a0[m]);
    out1[m] = r1 ? _mm512_reduce_add_ps(a1[m]) : 0.f;
  }
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16 takes bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) <= kGemvMaxRows, "gemv_bf16 shapes");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  torch::Tensor bc;
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    bp = bc.data_ptr<c10::BFloat16>();
  }
  auto rows = M == 1 ? gemv_rows<1> : M == 2 ? gemv_rows<2> : M == 3 ? gemv_rows<3> : gemv_rows<4>;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    const int64_t half = (end - begin) / 2;
    float o0[kGemvMaxRows], o1[kGemvMaxRows];
    auto store = [&](int64_t n, const float* o) {
      const float b = bp ? static_cast<float>(bp[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = c10::BFloat16(o[m] + b);
    };
    for (int64_t i = 0; i < half; ++i) {
      const int64_t n0 = begin + i, n1 = begin + half + i;
      rows(xp, K, wp + n0 * K, wp + n1 * K, o0, o1);
      store(n0, o0);
      store(n1, o1);
    }
    if ((end - begin) % 2) {
      rows(xp, K, wp + (end - 1) * K, nullptr, o0, o1);
      store(end - 1, o0);
    }
  });
  return y;
}

// ---- small-M GEMV on one-byte weights: y = x . (Wq * scale[n])^T (+ bias), Wq int8 or fp8 (e4m3) ---------
// The same two-streams-per-thread walk as gemv_bf16, reading one byte per weight: the bytes are widened
// to float32 in registers (int8: sign-extend and convert; e4m3: rebuild the float32 bit pattern, with
// subnormals as mant * 2^-9), multiplied into float32 accumulators, and the per-row scale is applied once.
template <bool kFp8>
inline __m512 widen16(const uint8_t* p, __mmask16 mask) {
  const __m128i b = _mm_maskz_loadu_epi8(mask, p);
  if constexpr (!kFp8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    const __m512i u = _mm512_cvtepu8_epi32(b);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
    const __m512i exp = _mm512_and_si512(_mm512_srli_epi32(u, 3), _mm512_set1_epi32(0xF));
    const __m512i mant = _mm512_and_si512(u, _mm512_set1_epi32(0x7));
    const __m512i normal = _mm512_or_si512(sign, _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(exp, _mm512_set1_epi32(120)), 23),
                                                                  _mm512_slli_epi32(mant, 20)));
    const __mmask16 sub = _mm512_cmpeq_epi32_mask(exp, _mm512_setzero_si512());
    const __m512 subv = _mm512_or_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(mant), _mm512_set1_ps(1.0f / 512.0f)),
                                     _mm512_castsi512_ps(sign));
    return _mm512_mask_blend_ps(sub, _mm512_castsi512_ps(normal), subv);
  }
}

template <int64_t M, bool kFp8>
inline void gemv_q8_rows(const float* x, int64_t K, const uint8_t* r0, const uint8_t* r1,
                         float out0[kGemvMaxRows], float out1[kGemvMaxRows]) {
  __m512 a0[kGemvMaxRows], a1[kGemvMaxRows];
  for (int64_t m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    const __m512 w0 = widen16<kFp8>(r0 + k, mask);
    const __m512 w1 = r1 ? widen16<kFp8>(r1 + k, mask) : w0;
    for (int64_t m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      a0[m] = _mm512_fmadd_ps(w0, xv, a0[m]);
      if (r1) a1[m] = _mm512_fmadd_ps(w1, xv, a1[m]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    out0[m] = _mm512_reduce_add_ps(a0[m]);
    out1[m] = r1 ? _mm512_reduce_add_ps(a1[m]) : 0.f;
  }
}

template <bool kFp8>
void gemv_q8_impl(const float* xp, const uint8_t* wp, const float* sp, const c10::BFloat16* bp, c10::BFloat16* yp,
                  int64_t M, int64_t K, int64_t N) {
  auto rows = M == 1 ? gemv_q8_rows<1, kFp8> : M == 2 ? gemv_q8_rows<2, kFp8> : M == 3 ? gemv_q8_rows<3, kFp8> : gemv_q8_rows<4, kFp8>;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    const int64_t half = (end - begin) / 2;
    float o0[kGemvMaxRows], o1[kGemvMaxRows];
    auto store = [&](int64_t n, const float* o) {
      const float b = bp ? static_cast<float>(bp[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = c10::BFloat16(o[m] * sp[n] + b);
    };
    for (int64_t i = 0; i < half; ++i) {
      const int64_t n0 = begin + i, n1 = begin + half + i;
      rows(xp, K, wp + n0 * K, wp + n1 * K, o0, o1);
      store(n0, o0);
      store(n1, o1);
    }
    if ((end - begin) % 2) {
      rows(xp, K, wp + (end - 1) * K, nullptr, o0, o1);
      store(end - 1, o0);
    }
  });
}

// x [M, K] bf16 (M <= 4), w [N, K] int8 or float8_e4m3fn, scale [N] float32, bias [N] bf16 -> y [M, N] bf16
torch::Tensor gemv_q8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && (fp8 || w.scalar_type() == at::kChar), "gemv_q8 takes bf16 x, int8/fp8 w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) <= kGemvMaxRows, "gemv_q8 shapes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "gemv_q8 scale");
  auto xf = x.to(at::kFloat).contiguous();
  auto wc = w.contiguous();
  auto sc = scale.contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bc;
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kBFloat16).contiguous();
    bp = bc.data_ptr<c10::BFloat16>();
  }
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(wc.data_ptr());
  if (fp8)
    gemv_q8_impl<true>(xf.data_ptr<float>(), wp, sc.data_ptr<float>(), bp, y.data_ptr<c10::BFloat16>(), M, K, N);
  else
    gemv_q8_impl<false>(xf.data_ptr<float>(), wp, sc.data_ptr<float>(), bp, y.data_ptr<c10::BFloat16>(), M, K, N);
  return y;
}

// w [N, K] int8 or float8_e4m3fn, scale [N] float32 -> bf16 [N, K] = w * scale[n], at memory speed, for the
// GEMM that larger batches run (PyTorch's own float8 -> bf16 conversion goes element by element on CPU).
torch::Tensor dequant_q8(torch::Tensor w, torch::Tensor scale) {
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((fp8 || w.scalar_type() == at::kChar) && w.dim() == 2, "dequant_q8 takes int8/fp8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "dequant_q8 scale");
  auto wc = w.contiguous();
  auto sc = scale.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  auto out = torch::empty({N, K}, wc.options().dtype(at::kBFloat16));
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(wc.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* sp = sc.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const __m512 s = _mm512_set1_ps(sp[n]);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
        const __m512 v = _mm512_mul_ps(fp8 ? widen16<true>(wp + n * K + k, mask) : widen16<false>(wp + n * K + k, mask), s);
        _mm256_mask_storeu_epi16(op + n * K + k, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
  return out;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
#if defined(__AVX512BF16__)
  m.def("gemv_bf16", &gemv_bf16, "small-M bf16 GEMV with two read streams per thread (CPU, AVX512-BF16)");
  m.def("gemv_q8", &gemv_q8, "small-M GEMV on int8 / fp8-e4m3 weights with per-row scales (CPU, AVX512)");
  m.def("dequant_q8", &dequant_q8, "int8 / fp8-e4m3 weights with per-row scales -> bf16 (CPU, AVX512)");
  m.attr("gemv_max_rows") = kGemvMaxRows;
#endif
}
