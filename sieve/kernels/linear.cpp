// One linear layer's weight in the layout of a native kernel, callable on any batch: the same object
// serves the Python model (`Linear.forward`) and the native layer loop (decoder.cpp).
//
//   bf16   plain [N, K] for decode-sized batches (gemv.cpp), and oneDNN's prepacked layout for larger
//          ones where the loader kept one (`packed`); without it, ATen's linear on the plain weight.
//          The AVX2 build runs larger batches on float32 panels too (gemm_bf16_avx2_into), and so does an AVX512-BF16
//          CPU whose vdpbf16ps is slower than FMAs (gemm_bf16_fma_into).
//   q8     int8 / fp8 codes in the blocked layout of qmatmul.cpp, per-row float32 or per-group float16 scales
//   int4   the blocked int4 layout of qmatmul.cpp, float16 scale and min per group (GGUF Q4_0: no min); with
//          `q8_activations`, against int8 activations (qmatmul_q8act.cpp)
//   w8a8   int8 codes blocked for vpdpbusd, a float32 scale per row, against int8 activations per row (w8a8.cpp)
// Shapes and dtypes are checked once, here; the calls check only the input.
#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <type_traits>
#include <algorithm>

namespace sieve {

namespace {

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, c10::string_view("none"), c10::List<c10::optional<at::Scalar>>(),
                          c10::optional<c10::string_view>(c10::string_view(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

#if defined(SIEVE_HAS_QUANT)
// Tensor wrappers of the raw kernels (whichever ISA built them), for Python and the tests.

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16 takes bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvMaxRows, "gemv_bf16 takes 1 to ", kGemvMaxRows, " rows, got ", x.size(0));
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bc;
  const bf16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv_bf16: one bias per output");
    bc = bias->to(at::kBFloat16).contiguous();
    bp = bc.data_ptr<bf16>();
  }
  gemv_bf16_into(xc.data_ptr<bf16>(), M, K, wc.data_ptr<bf16>(), N, bp, y.data_ptr<bf16>());
  return y;
}

#if defined(__AVX512BF16__) || defined(__AVX2__)
// The float32 panels the linear takes above the GEMV's rows, called directly (tests): gemm_bf16.cpp's in the
// AVX512-BF16 build, qmatmul_avx2.cpp's in the AVX2 build.
torch::Tensor gemm_bf16_fma(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemm_bf16_fma takes bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemm_bf16_fma: x [M, K], w [N, K]");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bkeep;
  const float* bp = bias_pointer(bias, N, bkeep);
#if defined(__AVX512BF16__)
  if (M > 0) gemm_bf16_fma_into(xc.data_ptr<bf16>(), M, K, wc.data_ptr<bf16>(), N, bp, y.data_ptr<bf16>());
#else
  if (M > 0) gemm_bf16_avx2_into(xc.data_ptr<bf16>(), M, K, wc.data_ptr<bf16>(), N, bp, y.data_ptr<bf16>());
#endif
  return y;
}
#endif

// w [NBlocks, K2 / 2, 32] uint8 (int8 or fp8 codes, blocked); scale float32 [n] (group 0) or float16
// [NBlocks, K2 / group, 16] (group > 0, int8 only); bias [n] or none; x [M, K <= K2] bf16 or float32;
// returns [M, n] in x's dtype.
torch::Tensor qmatmul_q8(torch::Tensor x, torch::Tensor w, bool fp8, torch::Tensor scale, int64_t group,
                         c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == 32 && w.is_contiguous(),
              "qmatmul_q8 takes blocked uint8 [N/16, K/2, 32]");
  const int64_t blocks = w.size(0), K2 = w.size(1) * 2;
  TORCH_CHECK(n <= blocks * 16, "qmatmul_q8: n exceeds the blocked rows");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= K2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or float32 [M, K] with K <= ", K2);
  if (group == 0) {
    TORCH_CHECK(scale.numel() == n && scale.scalar_type() == at::kFloat, "qmatmul_q8 takes [n] float32 row scales");
  } else {
    TORCH_CHECK(!fp8 && group % 2 == 0 && K2 % group == 0, "qmatmul_q8: group scales take int8 codes and an even group dividing K");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.numel() == blocks * (K2 / group) * 16,
                "qmatmul_q8: group scales are float16 [N/16, G, 16]");
  }
  auto xc = x.contiguous();
  auto sc = scale.contiguous();
  torch::Tensor bkeep;
  const float* bp = bias_pointer(bias, n, bkeep);
  auto y = torch::empty({xc.size(0), n}, x.options());
  qmatmul_q8_into(xc.data_ptr(), xc.scalar_type() == at::kFloat, xc.size(0), xc.size(1), w.data_ptr<uint8_t>(), blocks, K2, fp8,
                  group == 0 ? sc.data_ptr<float>() : nullptr, group == 0 ? nullptr : sc.data_ptr<c10::Half>(), group, bp, n,
                  y.data_ptr());
  return y;
}

// w [NBlocks, Kp / 4, 32] uint8 (int4, blocked), scale and min float16 [NBlocks, G, 16] (no min: w = (q - 8) s),
// group a multiple of 4 dividing Kp, bias [n] or none; returns [M, n] in x's dtype
torch::Tensor qmatmul_int4(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> min, int64_t group,
                           c10::optional<torch::Tensor> bias, int64_t n, bool q8_activations) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == 32 && w.is_contiguous(),
              "qmatmul_int4 takes blocked uint8 [N/16, K/4, 32]");
  const int64_t blocks = w.size(0), K2 = w.size(1) * 4;
  TORCH_CHECK(group > 0 && group % 4 == 0 && K2 % group == 0, "qmatmul_int4: the group must be a multiple of 4 dividing K");
  TORCH_CHECK(!q8_activations || group % 32 == 0, "qmatmul_int4: int8 activations take weight groups of a multiple of 32 inputs");
  const int64_t G = K2 / group;
  const bool has_min = min.has_value() && min->defined();
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.numel() == blocks * G * 16 && n <= blocks * 16 &&
              (!has_min || (min->scalar_type() == at::kHalf && min->numel() == blocks * G * 16)),
              "qmatmul_int4: scale and min are float16 [N/16, G, 16]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= K2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or float32 [M, K] with K <= ", K2);
  auto xc = x.contiguous();
  auto sc = scale.contiguous();
  auto mc = has_min ? min->contiguous() : torch::Tensor();
  torch::Tensor bkeep;
  const float* bp = bias_pointer(bias, n, bkeep);
  auto y = torch::empty({xc.size(0), n}, x.options());
  auto* kernel = q8_activations ? &qmatmul_int4_q8act_into : &qmatmul_int4_into;
  kernel(xc.data_ptr(), xc.scalar_type() == at::kFloat, xc.size(0), xc.size(1), w.data_ptr<uint8_t>(), blocks, K2, sc.data_ptr<c10::Half>(),
         has_min ? mc.data_ptr<c10::Half>() : nullptr, group, bp, n, y.data_ptr());
  return y;
}
#endif

NativeLinear::NativeLinear(int64_t kind, torch::Tensor w, c10::optional<torch::Tensor> packed, c10::optional<torch::Tensor> scale,
                           c10::optional<torch::Tensor> aux, bool fp8, int64_t group, int64_t n, int64_t k,
                           c10::optional<torch::Tensor> bias)
    : kind(kind), n(n), group(group), fp8(fp8), k(k), w(w.contiguous()), bias(bias) {
  if (packed.has_value() && packed->defined()) this->packed = *packed;
  if (scale.has_value() && scale->defined()) this->scale = scale->contiguous();
  if (aux.has_value() && aux->defined()) this->aux = aux->contiguous();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "native linear: one bias per output");
    bias_bf16 = bias->to(at::kBFloat16).contiguous();
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  const auto& W = this->w;
  switch (kind) {
    case kBF16:
      TORCH_CHECK(W.scalar_type() == at::kBFloat16 && W.dim() == 2 && W.size(0) == n && W.size(1) == k, "bf16 linear takes a [n, k] weight");
      break;
    case kQ8:
      TORCH_CHECK(W.scalar_type() == at::kByte && W.dim() == 3 && W.size(2) == 32 && n <= W.size(0) * 16 && k <= W.size(1) * 2,
                  "q8 linear takes blocked uint8 [N/16, K/2, 32]");
      if (group == 0) {
        TORCH_CHECK(this->scale.scalar_type() == at::kFloat && this->scale.numel() == n, "q8 linear: [n] float32 row scales");
      } else {
        const int64_t K2 = W.size(1) * 2;
        TORCH_CHECK(!fp8 && group % 2 == 0 && K2 % group == 0 && this->scale.scalar_type() == at::kHalf &&
                    this->scale.numel() == W.size(0) * (K2 / group) * 16, "q8 linear: float16 group scales [N/16, G, 16], int8 codes");
      }
      break;
    case kInt4: {
      const int64_t K2 = W.size(1) * 4;
      TORCH_CHECK(W.scalar_type() == at::kByte && W.dim() == 3 && W.size(2) == 32 && n <= W.size(0) * 16 && k <= K2,
                  "int4 linear takes blocked uint8 [N/16, K/4, 32]");
      TORCH_CHECK(group > 0 && group % 4 == 0 && K2 % group == 0, "int4 linear: the group must be a multiple of 4 dividing K");
      TORCH_CHECK(this->scale.scalar_type() == at::kHalf && this->scale.numel() == W.size(0) * (K2 / group) * 16 &&
                  (!this->aux.defined() || (this->aux.scalar_type() == at::kHalf && this->aux.numel() == this->scale.numel())),
                  "int4 linear: float16 scale and min [N/16, G, 16]");
      break;
    }
    case kW8A8:
      TORCH_CHECK(w8a8_native(), "this CPU build (", SIEVE_ISA, ") has no int8 dot products for a W8A8 linear");
      TORCH_CHECK(W.scalar_type() == at::kChar && W.dim() == 3 && W.size(2) == 64 && n <= W.size(0) * 16 && k <= W.size(1) * 4,
                  "w8a8 linear takes blocked int8 [N/16, K/4, 64]");
      TORCH_CHECK(this->scale.scalar_type() == at::kFloat && this->scale.numel() == W.size(0) * 16 && this->aux.defined() &&
                  this->aux.scalar_type() == at::kInt && this->aux.numel() == W.size(0) * 16,
                  "w8a8 linear: float32 scales and int32 row sums [N/16 * 16]");
      return;  // no SIEVE_HAS_QUANT needed: the AVX512-VNNI build has it, and no other builds the kind
    default: TORCH_CHECK(false, "unknown native linear kind ", kind);
  }
#if !defined(SIEVE_HAS_QUANT)
  TORCH_CHECK(false, "this CPU build (", SIEVE_ISA, ") has no native linear kernels");
#endif
}

template <class T>
void NativeLinear::forward_into(const T* x, int64_t M, T* y) const {
  constexpr bool f32 = std::is_same_v<T, float>;
  const float* bf = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  switch (kind) {
#if defined(SIEVE_HAS_QUANT)
    case kBF16:
      if constexpr (!f32) {
        const bf16* bb = bias_bf16.defined() ? bias_bf16.data_ptr<bf16>() : nullptr;
        if (M <= kGemvMaxRows) return gemv_bf16_into(x, M, k, w.data_ptr<bf16>(), n, bb, y);
        if (batch_invariant) {
          for (int64_t i = 0; i < M; i += kGemvMaxRows)
            gemv_bf16_into(x + i * k, std::min<int64_t>(kGemvMaxRows, M - i), k, w.data_ptr<bf16>(), n, bb, y + i * n);
          return;
        }
#if defined(__AVX2__) && !defined(__AVX512BF16__)
        return gemm_bf16_avx2_into(x, M, k, w.data_ptr<bf16>(), n, bf, y);  // ATen's bf16 GEMM is ~12x slower here
#elif defined(__AVX512BF16__)
        if (use_fma_dots()) return gemm_bf16_fma_into(x, M, k, w.data_ptr<bf16>(), n, bf, y);  // FMAs beat vdpbf16ps here
#endif
      }
      break;
    case kQ8:
      return qmatmul_q8_into(x, f32, M, k, w.data_ptr<uint8_t>(), w.size(0), w.size(1) * 2, fp8, group == 0 ? scale.data_ptr<float>() : nullptr,
                             group == 0 ? nullptr : scale.data_ptr<c10::Half>(), group, bf, n, y);
    case kW8A8:
      return w8a8_into(x, f32, M, k, w.data_ptr<int8_t>(), w.size(0), w.size(1), aux.data_ptr<int32_t>(), scale.data_ptr<float>(), bf,
                       n, y);
    case kInt4:
      if (q8_activations)
        return qmatmul_int4_q8act_into(x, f32, M, k, w.data_ptr<uint8_t>(), w.size(0), w.size(1) * 4, scale.data_ptr<c10::Half>(),
                                       aux.defined() ? aux.data_ptr<c10::Half>() : nullptr, group, bf, n, y);
      return qmatmul_int4_into(x, f32, M, k, w.data_ptr<uint8_t>(), w.size(0), w.size(1) * 4, scale.data_ptr<c10::Half>(),
                               aux.defined() ? aux.data_ptr<c10::Half>() : nullptr, group, bf, n, y);
#endif
    default: break;
  }
  // bf16 above the GEMV's rows: oneDNN (or ATen) on tensors over the same memory
  TORCH_CHECK(!f32, "a bf16 native linear takes bf16 activations");
  auto opts = torch::TensorOptions().dtype(at::kBFloat16);
  auto xt = torch::from_blob(const_cast<T*>(x), {M, k}, opts);
  auto yt = packed.defined() ? onednn_linear(xt, packed, bias) : at::linear(xt, w, bias);
  std::memcpy(y, yt.data_ptr(), M * n * sizeof(T));
}

template void NativeLinear::forward_into<bf16>(const bf16*, int64_t, bf16*) const;
template void NativeLinear::forward_into<float>(const float*, int64_t, float*) const;

torch::Tensor NativeLinear::forward(const torch::Tensor& x) const {
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && (x.scalar_type() == at::kBFloat16 || (f32 && kind != kBF16)),
              "native linear takes [M, ", k, "] activations in bf16 (or float32 for quantized weights)");
  auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), n}, x.options());
  if (f32) forward_into(xc.data_ptr<float>(), xc.size(0), y.data_ptr<float>());
  else forward_into(xc.data_ptr<bf16>(), xc.size(0), y.data_ptr<bf16>());
  return y;
}

}  // namespace sieve
