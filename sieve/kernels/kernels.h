// The native CPU kernels sieve builds on first use (sieve/kernels/__init__.py), declared for module.cpp.
#pragma once
#include <torch/extension.h>

namespace sieve {

// attention.cpp: one query token per sequence against its paged K/V (model dtype, fp8 or int8 codes)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, c10::optional<torch::Tensor> k_scale,
                                     c10::optional<torch::Tensor> v_scale);

// layer_ops.cpp: a decoder layer's small operations, fused (bf16)
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps);
void rotary_(torch::Tensor qk, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);

#if defined(__AVX512BF16__)
// gemv.cpp: bf16 weights, decode-sized batches
constexpr int64_t kGemvMaxRows = 4;
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

// qmatmul.cpp: int8 / fp8 / int4 weights in the blocked layouts of sieve/quant/kernels.py, any batch
torch::Tensor qmatmul_q8(torch::Tensor x, torch::Tensor w, bool fp8, torch::Tensor row_scale,
                         c10::optional<torch::Tensor> bias, int64_t n);
torch::Tensor qmatmul_int4(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor zshift, int64_t group,
                           c10::optional<torch::Tensor> bias, int64_t n);
#endif

}  // namespace sieve
