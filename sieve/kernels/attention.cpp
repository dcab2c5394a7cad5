// Paged decode attention (CPU): one query token per sequence, K/V read in place from the
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
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <math.h>

#include <cstring>
#include <vector>

namespace sieve {

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

}  // namespace

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

}  // namespace sieve
