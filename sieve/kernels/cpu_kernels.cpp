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
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
#if defined(__AVX512BF16__)
  m.def("gemv_bf16", &gemv_bf16, "small-M bf16 GEMV with two read streams per thread (CPU, AVX512-BF16)");
  m.attr("gemv_max_rows") = kGemvMaxRows;
#endif
}
