// The small per-layer operations of a decoder, fused (CPU, bf16 or float32 activations): at batch 1 a
// layer is a few large matrix products and ~40 small PyTorch ops whose fixed costs (dispatch,
// allocation, a pass over memory each) added 5 ms to a 27 ms step of a 0.5B model. Each kernel does in
// one call what several ops did, and in bf16 rounds where the reference (Hugging Face, in bf16)
// rounds (in float32 the roundings below are no-ops):
//
//   add_rms_norm  s = x + residual (bf16), h = bf16(s * rsqrt(mean(s^2) + eps)), out = bf16(w * h),
//                 returning (out, s); without a residual, s = x.
//   rotary_       in place on q/k heads: (a, b) = halves of a head, c = bf16(cos), s = bf16(sin):
//                 a' = bf16(bf16(a c) - bf16(b s)), b' = bf16(bf16(b c) + bf16(a s)).
//   silu_mul      [T, 2I] (gate | up) -> bf16(bf16(silu(gate)) * up), silu in float32.
//   apply_token_bitmask_  structured outputs: forbidden tokens' logits to -inf (float32), a word of 32 at a time.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>

namespace sieve {

namespace {

constexpr int64_t kMaxNormWidth = 16384;
inline float f32(bf16 v) { return static_cast<float>(v); }
inline float f32(float v) { return v; }
template <class T>
inline float rnd(float v) {  // what storing in T and reading back gives
  return static_cast<float>(T(v));
}

}  // namespace

template <class T>
void add_rms_norm_into(const T* x, int64_t x_stride, T* residual, const T* w, int64_t rows, int64_t H, float eps, T* out) {
  TORCH_CHECK(H <= kMaxNormWidth, "add_rms_norm takes rows of at most ", kMaxNormWidth);
  at::parallel_for(0, rows, 16, [&](int64_t t0, int64_t t1) {
    float s[kMaxNormWidth];
    for (int64_t t = t0; t < t1; ++t) {
      const T* xr = x + t * x_stride;
      T* sr = residual ? residual + t * H : nullptr;
      if (sr) {
        for (int64_t i = 0; i < H; ++i) sr[i] = T(f32(xr[i]) + f32(sr[i]));
        xr = sr;
      }
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < H; ++i) {
        s[i] = f32(xr[i]);
        sq += s[i] * s[i];
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + eps);
      T* orow = out + t * H;
      for (int64_t i = 0; i < H; ++i) orow[i] = T(f32(w[i]) * rnd<T>(s[i] * inv));
    }
  });
}

template <class T>
void rotary_into(T* qk, int64_t rows, int64_t heads, int64_t row_stride, int64_t D, const int64_t* positions, const float* cos,
                 const float* sin, int64_t P) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(positions[t] >= 0 && positions[t] < P, "position out of the rotary table");
  at::parallel_for(0, rows, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = qk + t * row_stride + h * D;
        T* b = a + half;
        for (int64_t i = 0; i < half; ++i) {
          const float ci = rnd<T>(c[i]), si = rnd<T>(s[i]), ai = f32(a[i]), bi = f32(b[i]);
          a[i] = T(rnd<T>(ai * ci) - rnd<T>(bi * si));
          b[i] = T(rnd<T>(bi * ci) + rnd<T>(ai * si));
        }
      }
    }
  });
}

template <class T>
void silu_mul_into(const T* gate_up, int64_t rows, int64_t I, int64_t stride, T* out) {
  at::parallel_for(0, rows * I, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin / I; t <= (end - 1) / I; ++t) {
      const T* g = gate_up + t * stride;
      const T* u = g + I;
      T* o = out + t * I;
      const int64_t i0 = t == begin / I ? begin % I : 0, i1 = t == (end - 1) / I ? (end - 1) % I + 1 : I;
      for (int64_t i = i0; i < i1; ++i) {
        const float gv = f32(g[i]);
        o[i] = T(rnd<T>(gv / (1.f + std::exp(-gv))) * f32(u[i]));
      }
    }
  });
}

template void add_rms_norm_into<bf16>(const bf16*, int64_t, bf16*, const bf16*, int64_t, int64_t, float, bf16*);
template void add_rms_norm_into<float>(const float*, int64_t, float*, const float*, int64_t, int64_t, float, float*);
template void rotary_into<bf16>(bf16*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, const float*, int64_t);
template void rotary_into<float>(float*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, const float*, int64_t);
template void silu_mul_into<bf16>(const bf16*, int64_t, int64_t, int64_t, bf16*);
template void silu_mul_into<float>(const float*, int64_t, int64_t, int64_t, float*);

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps) {
  // bf16, or float32 (the Python layer loop of a float32 model: the native loop's own arithmetic, so that both loops
  // give the same bits; F.rms_norm sums the squares in another order)
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && x.dim() == 2 && x.stride(1) == 1,
              "x must be bf16 or float32 [T, H] with contiguous rows");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.scalar_type() == dtype && weight.numel() == H, "weight must be [H] in x's dtype");
  const bool add = residual.has_value() && residual->defined();
  TORCH_CHECK(!add || (residual->scalar_type() == dtype && residual->dim() == 2 && residual->size(0) == T && residual->size(1) == H),
              "residual must match x");
  auto out = torch::empty({T, H}, x.options());
  auto sum = add ? residual->contiguous().clone() : x;
  auto run = [&]<class E>() {
    add_rms_norm_into<E>(x.data_ptr<E>(), x.stride(0), add ? sum.data_ptr<E>() : nullptr, weight.contiguous().data_ptr<E>(), T, H,
                         static_cast<float>(eps), out.data_ptr<E>());
  };
  if (dtype == at::kFloat) run.template operator()<float>();
  else run.template operator()<bf16>();
  return {out, sum};
}

// rotary_ and silu_mul take float32 too: the Python layer loop of a float32 model then runs the C++ loop's own
// arithmetic (PyTorch's ops round otherwise: its mul-and-add against the kernels' contracted FMAs, its exp), so that
// both loops give the same bits
void rotary_(torch::Tensor qk, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  const auto dtype = qk.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be bf16 or float32 [T, heads, D] with contiguous heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qk.size(0), "one int64 position per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(1) * 2 == qk.size(2), "cos / sin must be float32 [positions, D / 2]");
  auto pc = positions.contiguous();
  auto run = [&]<class E>() {
    rotary_into<E>(qk.data_ptr<E>(), qk.size(0), qk.size(1), qk.stride(0), qk.size(2), pc.data_ptr<int64_t>(), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), cos.size(0));
  };
  if (dtype == at::kFloat) run.template operator()<float>();
  else run.template operator()<bf16>();
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && gate_up.dim() == 2 && gate_up.stride(1) == 1,
              "gate_up must be bf16 or float32 [T, 2I] with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  if (dtype == at::kFloat) silu_mul_into<float>(gate_up.data_ptr<float>(), T, I, gate_up.stride(0), out.data_ptr<float>());
  else silu_mul_into<bf16>(gate_up.data_ptr<bf16>(), T, I, gate_up.stride(0), out.data_ptr<bf16>());
  return out;
}

torch::Tensor dequantize_rows_q8(torch::Tensor q, torch::Tensor scale, torch::Tensor ids, at::ScalarType dtype) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "codes must be contiguous int8 [V, K]");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == q.size(0) && q.size(1) % scale.size(1) == 0 &&
              scale.is_contiguous(), "scales must be contiguous float16 [V, G]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rows come out as float32 or bf16");
  const int64_t T = ids.size(0), V = q.size(0), K = q.size(1), G = scale.size(1), group = K / G;
  auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < V, "token id ", id[t], " out of the embedding's ", V, " rows");
  auto out = torch::empty({T, K}, q.options().dtype(dtype));
  const int8_t* qp = q.data_ptr<int8_t>();
  const c10::Half* sp = scale.data_ptr<c10::Half>();
  for (int64_t t = 0; t < T; ++t) {  // w = q * s in float32, as gguf dequantizes Q8_0, then the model dtype
    const int8_t* row = qp + id[t] * K;
    const c10::Half* srow = sp + id[t] * G;
    if (dtype == at::kFloat) {
      float* o = out.data_ptr<float>() + t * K;
      for (int64_t i = 0; i < K; ++i) o[i] = static_cast<float>(row[i]) * static_cast<float>(srow[i / group]);
    } else {
      bf16* o = out.data_ptr<bf16>() + t * K;
      for (int64_t i = 0; i < K; ++i) o[i] = bf16(static_cast<float>(row[i]) * static_cast<float>(srow[i / group]));
    }
  }
  return out;
}

void apply_token_bitmask_(torch::Tensor logits, torch::Tensor mask, torch::Tensor rows) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous(), "logits must be contiguous float32 [B, V]");
  TORCH_CHECK(mask.dtype() == torch::kInt32 && mask.dim() == 2 && mask.is_contiguous(), "mask must be contiguous int32 [R, W]");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1 && rows.size(0) == mask.size(0), "rows must be int64 [R]");
  const int64_t B = logits.size(0), V = logits.size(1), W = mask.size(1), R = rows.size(0);
  float* L = logits.data_ptr<float>();
  const uint32_t* M = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  const int64_t* idx = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(idx[i] >= 0 && idx[i] < B, "row index out of range");
  const float neg = -INFINITY;
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = L + idx[i] * V;
      const uint32_t* m = M + i * W;
      const int64_t words = std::min<int64_t>(W, (V + 31) / 32);
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        float* x = row + w * 32;
        const int64_t n = std::min<int64_t>(32, V - w * 32);
        if (bits == 0) {
          for (int64_t j = 0; j < n; ++j) x[j] = neg;
          continue;
        }
#if defined(__AVX512F__)
        if (n == 32) {  // the word's bits are the lanes' masks
          const __m512 ninf = _mm512_set1_ps(neg);
          _mm512_storeu_ps(x, _mm512_mask_blend_ps(static_cast<__mmask16>(bits & 0xFFFFu), ninf, _mm512_loadu_ps(x)));
          _mm512_storeu_ps(x + 16, _mm512_mask_blend_ps(static_cast<__mmask16>(bits >> 16), ninf, _mm512_loadu_ps(x + 16)));
          continue;
        }
#endif
        for (int64_t j = 0; j < n; ++j) x[j] = ((bits >> j) & 1u) ? x[j] : neg;
      }
      for (int64_t v = words * 32; v < V; ++v) row[v] = neg;  // past the mask's vocabulary: never allowed
    }
  });
}

}  // namespace sieve
