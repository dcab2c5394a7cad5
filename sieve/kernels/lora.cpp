// LoRA's low-rank products (sieve/lora): y[s:e] += (x[s:e] A^T) B^T for each run of rows that one adapter serves, in
// the layer loop (NativeDecoder) and from Python's layer loop (NativeLoRA.apply), with the same arithmetic both ways:
// float32 sums in registers, t = x A^T kept in float32, each output rounded once to the activations' dtype on its add.
//
// An adapter's bytes are what a step reads of it (a rank-16 adapter on every linear of SmolLM2 is 9.6 MB in bf16), so
// its matrices are kept the way the products read them: A^T [in, R] and B^T [R, out] cut into panels of up to 32
// columns, each panel [K][width] contiguous. A tile of 4 rows by 32 outputs then streams one panel front to back,
// each k's 32 weights widened once and added, scaled by each row's value, to the tile's registers; B's panels are
// split over the threads.
#include "kernels.h"

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace sieve {

namespace {

constexpr int64_t kRows = 4, kCols = 32;
typedef float v16f __attribute__((vector_size(64)));  // 16 float32 lanes: one AVX-512 register, two AVX2 ones

// n values widened to float32 (bf16: by its bits, through memcpy: a uint32 store into floats would alias)
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const bf16* src, float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))), 16)));
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))), 16)));
#endif
  for (; j < n; ++j) {
    const uint32_t bits = static_cast<uint32_t>(src[j].x) << 16;
    std::memcpy(dst + j, &bits, sizeof bits);
  }
}

// dst[j] += add[j], rounded once to the activations' dtype (bf16: to nearest even, by its bits, as c10 rounds)
inline void add_rounded(float* dst, const float* add, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] += add[j];
}
inline void add_rounded(bf16* dst, const float* add, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float f;
    const uint32_t widened = static_cast<uint32_t>(dst[j].x) << 16;
    std::memcpy(&f, &widened, sizeof f);
    f += add[j];
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    dst[j].x = std::isnan(f) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// acc[i * kCols + j] = sum_k in[i, k] * panel[k, j] for the tile's rows (`rows` of kRows real): `in` float32 [rows, K]
// (stride in_ld), `panel` [K][width] of W, width <= kCols (the rest of the tile's columns are zeros).
template <class W>
void tile_product(const float* __restrict in, int64_t in_ld, int64_t rows, int64_t K, const W* __restrict panel, int64_t width,
                  float* __restrict acc) {
  v16f sum[kRows][2] = {};
  alignas(64) float wk[kCols] = {};
  for (int64_t k = 0; k < K; ++k) {
    widen(panel + k * width, wk, width);
    v16f w0, w1;
    std::memcpy(&w0, wk, sizeof w0);
    std::memcpy(&w1, wk + 16, sizeof w1);
    for (int64_t i = 0; i < kRows; ++i) {
      const float v = i < rows ? in[i * in_ld + k] : 0.f;
      sum[i][0] += v * w0;
      sum[i][1] += v * w1;
    }
  }
  std::memcpy(acc, sum, sizeof sum);
}

// M [K, N] as panels of up to kCols columns, each [K][width] contiguous (panel c0 at K * c0)
torch::Tensor pack_panels(const torch::Tensor& m) {
  const int64_t K = m.size(0), N = m.size(1);
  auto out = torch::empty({K * N}, m.options());
  for (int64_t c0 = 0; c0 < N; c0 += kCols) {
    const int64_t w = std::min(kCols, N - c0);
    out.narrow(0, K * c0, K * w).view({K, w}).copy_(m.narrow(1, c0, w));
  }
  return out;
}

}  // namespace

namespace {

// t = x A^T for one span's rows (float32 [n, R])
template <class W>
void low_rank_in(const float* xf, int64_t n, int64_t in, const W* Ap, int64_t R, float* t) {
  float acc[kRows * kCols];
  for (int64_t c0 = 0; c0 < R; c0 += kCols) {
    const int64_t w = std::min(kCols, R - c0);
    for (int64_t i0 = 0; i0 < n; i0 += kRows) {
      const int64_t rows = std::min(kRows, n - i0);
      tile_product<W>(xf + i0 * in, in, rows, in, Ap + in * c0, w, acc);
      for (int64_t i = 0; i < rows; ++i) std::memcpy(t + (i0 + i) * R + c0, acc + i * kCols, w * sizeof(float));
    }
  }
}

// y += t B^T for one span's rows and one panel of outputs
template <class E, class W>
void low_rank_out_tile(const float* t, int64_t n, int64_t R, const W* Bp, int64_t out, int64_t tile, E* y, int64_t y_stride) {
  float acc[kRows * kCols];
  const int64_t o0 = tile * kCols, w = std::min(kCols, out - o0);
  for (int64_t i0 = 0; i0 < n; i0 += kRows) {
    const int64_t rows = std::min(kRows, n - i0);
    tile_product<W>(t + i0 * R, R, rows, R, Bp + R * o0, w, acc);
    for (int64_t i = 0; i < rows; ++i) add_rounded(y + (i0 + i) * y_stride + o0, acc + i * kCols, w);
  }
}

}  // namespace

template <class E>
void NativeLoRA::apply_spans(const std::vector<std::shared_ptr<NativeLoRA>>& loras, const std::vector<int64_t>& spans, int64_t layer,
                             int64_t module, const E* x, int64_t in, E* y, int64_t out) {
  // the spans this module changes: (mat, first row, rows)
  std::vector<std::tuple<const Mat*, int64_t, int64_t>> work;
  for (size_t i = 0; i + 2 < spans.size(); i += 3) {
    const Mat& m = loras[spans[i]]->mats[layer][module];
    if (m.a.defined() && spans[i + 2] > spans[i + 1]) work.emplace_back(&m, spans[i + 1], spans[i + 2] - spans[i + 1]);
  }
  if (work.empty()) return;
  // t = x A^T per span (one parallel region for them all), then y += t B^T over every (span, output panel) pair (one more)
  std::vector<std::vector<float>> ts(work.size());
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> xf;
    for (int64_t j = b0; j < b1; ++j) {
      const auto& [m, s, n] = work[j];
      xf.resize(n * in);
      for (int64_t i = 0; i < n; ++i) widen(x + (s + i) * in, xf.data() + i * in, in);
      ts[j].resize(n * m->r);
      if (m->a.scalar_type() == at::kBFloat16) low_rank_in<bf16>(xf.data(), n, in, m->a.data_ptr<bf16>(), m->r, ts[j].data());
      else low_rank_in<float>(xf.data(), n, in, m->a.data_ptr<float>(), m->r, ts[j].data());
    }
  });
  const int64_t tiles = (out + kCols - 1) / kCols, total = tiles * static_cast<int64_t>(work.size());
  at::parallel_for(0, total, std::max<int64_t>(1, total / (2 * at::get_num_threads())), [&](int64_t b0, int64_t b1) {
    for (int64_t job = b0; job < b1; ++job) {
      const int64_t j = job / tiles, tile = job % tiles;
      const auto& [m, s, n] = work[j];
      if (m->a.scalar_type() == at::kBFloat16)
        low_rank_out_tile<E, bf16>(ts[j].data(), n, m->r, m->b.data_ptr<bf16>(), out, tile, y + s * out, out);
      else if constexpr (std::is_same_v<E, float>)
        low_rank_out_tile<float, float>(ts[j].data(), n, m->r, m->b.data_ptr<float>(), out, tile, y + s * out, out);
    }
  });
}

template void NativeLoRA::apply_spans<float>(const std::vector<std::shared_ptr<NativeLoRA>>&, const std::vector<int64_t>&, int64_t, int64_t,
                                             const float*, int64_t, float*, int64_t);
template void NativeLoRA::apply_spans<bf16>(const std::vector<std::shared_ptr<NativeLoRA>>&, const std::vector<int64_t>&, int64_t, int64_t,
                                            const bf16*, int64_t, bf16*, int64_t);

bool lora_dtypes_ok(at::ScalarType activations, at::ScalarType weights) {
  return (activations == at::kFloat && (weights == at::kFloat || weights == at::kBFloat16)) ||
         (activations == at::kBFloat16 && weights == at::kBFloat16);
}

NativeLoRA::NativeLoRA(int64_t num_layers) : mats(num_layers) {}

void NativeLoRA::set(int64_t layer, int64_t module, torch::Tensor At, torch::Tensor Bt) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(mats.size()) && module >= 0 && module < 4, "layer or module out of range");
  TORCH_CHECK(At.dim() == 2 && Bt.dim() == 2 && Bt.size(0) == At.size(1) && At.scalar_type() == Bt.scalar_type() &&
              (At.scalar_type() == at::kFloat || At.scalar_type() == at::kBFloat16), "A^T [in, R] and B^T [R, out], float32 or bf16");
  mats[layer][module] = {pack_panels(At.contiguous()), pack_panels(Bt.contiguous()), At.size(0), At.size(1), Bt.size(1)};
}

bool NativeLoRA::takes(at::ScalarType activations) const {
  for (const auto& layer : mats)
    for (const auto& m : layer)
      if (m.a.defined() && !lora_dtypes_ok(activations, m.a.scalar_type())) return false;
  return true;
}

void NativeLoRA::apply(int64_t layer, int64_t module, torch::Tensor x, torch::Tensor y, int64_t start, int64_t end) const {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(mats.size()) && module >= 0 && module < 4, "layer or module out of range");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.scalar_type() == y.scalar_type() && x.stride(1) == 1 && y.stride(1) == 1 &&
              x.size(0) == y.size(0) && 0 <= start && start <= end && end <= x.size(0), "x [T, in] and y [T, out] with dense rows");
  const Mat& m = mats[layer][module];
  if (!m.a.defined()) return;
  TORCH_CHECK(x.size(1) == m.in && y.size(1) == m.out && x.is_contiguous() && y.is_contiguous() &&
              lora_dtypes_ok(x.scalar_type(), m.a.scalar_type()), "x and y do not fit this adapter's module");
  const std::vector<std::shared_ptr<NativeLoRA>> self{std::shared_ptr<NativeLoRA>(std::shared_ptr<NativeLoRA>{}, const_cast<NativeLoRA*>(this))};
  const std::vector<int64_t> spans{0, start, end};
  if (x.scalar_type() == at::kBFloat16)
    apply_spans<bf16>(self, spans, layer, module, x.data_ptr<bf16>(), m.in, y.data_ptr<bf16>(), m.out);
  else
    apply_spans<float>(self, spans, layer, module, x.data_ptr<float>(), m.in, y.data_ptr<float>(), m.out);
}

}  // namespace sieve
