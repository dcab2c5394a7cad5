// The decoder's layer loop in C++ (CPU, bf16 or float32 activations, a KV cache of the model dtype, bf16, float16, fp8 or int8),
// for every step: the same operations, in the same order and with the same kernels, as sieve/models/decoder.py and
// sieve/layers/attention.py, so that both give the same bits. A step of a small model is mostly
// fixed costs when it runs from Python: SmolLM2-135M has 30 layers of ~15 small operations, and
// at batch 1 their dispatch took ~4 ms of a 15 ms step; here the loop costs what the kernels cost.
//
// Per layer: h = norm(x [+ residual]); qkv = h W_qkv; q/k rotated in place (q/k-normed first for
// Qwen3); k, v written to their cache slots; decodes attend through their block tables (paged
// kernel), each prefill chunk's rows through that kernel too (float32 activations, and bf16 where it is faster; else
// SDPA over the chunk's earlier context plus itself); o = attn W_o;
// h = norm(o + residual); x = silu(h W_gate) * (h W_up) W_down. Then the final norm.
#include "kernels.h"

#include <cmath>

namespace sieve {

NativeDecoder::NativeDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                             torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm)
    : H(num_heads), KVH(num_kv_heads), D(head_dim), eps(eps), scale(scale), cos(cos.contiguous()), sin(sin.contiguous()),
      final_norm(final_norm.contiguous()) {
  TORCH_CHECK(this->cos.scalar_type() == at::kFloat && this->sin.scalar_type() == at::kFloat && this->cos.size(1) * 2 == D,
              "rotary tables must be float32 [positions, head_dim / 2]");
  dtype = this->final_norm.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "the native layer loop runs bf16 or float32 models");
}

void NativeDecoder::add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                              c10::optional<torch::Tensor> k_norm, std::shared_ptr<NativeLinear> qkv, std::shared_ptr<NativeLinear> o,
                              std::shared_ptr<NativeLinear> gate_up, std::shared_ptr<NativeLinear> down) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  const int64_t hidden = final_norm.numel();
  auto norm_ok = [&](const torch::Tensor& w, int64_t size) { return w.scalar_type() == dtype && w.is_contiguous() && w.numel() == size; };
  TORCH_CHECK(norm_ok(input_norm, hidden) && norm_ok(post_norm, hidden), "layer norms must be contiguous [hidden] in the model dtype");
  TORCH_CHECK(!q_norm.has_value() || (norm_ok(*q_norm, D) && norm_ok(*k_norm, D)), "q/k norms must be contiguous [head_dim] in the model dtype");
  TORCH_CHECK(dtype == at::kBFloat16 || (qkv->kind != NativeLinear::kBF16 && o->kind != NativeLinear::kBF16 &&
                                          gate_up->kind != NativeLinear::kBF16 && down->kind != NativeLinear::kBF16),
              "a float32 layer loop takes quantized linears only");
  TORCH_CHECK(qkv->k == hidden && qkv->n == (H + 2 * KVH) * D && o->k == H * D && o->n == hidden && gate_up->k == hidden &&
              gate_up->n % 2 == 0 && down->k == gate_up->n / 2 && down->n == hidden, "layer shapes do not fit the model");
  TORCH_CHECK(layers.empty() || (gate_up->n == layers[0].gate_up->n && q_norm.has_value() == layers[0].q_norm.defined()),
              "all layers must have one shape");
  layers.push_back({input_norm, post_norm, q_norm.value_or(torch::Tensor()), k_norm.value_or(torch::Tensor()), qkv, o, gate_up, down});
}

namespace {

torch::Tensor causal_mask_bottom_right(int64_t n, int64_t ctx, const torch::TensorOptions& opts) {
  auto q_pos = torch::arange(ctx - n, ctx, opts.dtype(torch::kLong)).unsqueeze(1);
  return torch::arange(ctx, opts.dtype(torch::kLong)).unsqueeze(0) <= q_pos;
}

template <class E>
torch::Tensor strided(const E* p, int64_t T, int64_t heads, int64_t D, int64_t row_stride) {
  return torch::from_blob(const_cast<E*>(p), {T, heads, D}, {row_stride, D, 1},
                          torch::TensorOptions().dtype(std::is_same_v<E, float> ? at::kFloat : at::kBFloat16));
}

template <class T>
const T* contiguous_ptr(const torch::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous(), name, " must be contiguous ", c10::toString(type));
  return t.data_ptr<T>();
}

// Rows t of `src` (n elements each, `stride` apart) into rows slot[t] of a 16-bit pool, rounded to nearest even as
// `Tensor.to` rounds (what KVCacheLayer.write_kv stores on the Python path).
template <class H, class E>
void store_rounded(void* pool, const int64_t* slot, const E* src, int64_t T, int64_t stride, int64_t n) {
  H* p = static_cast<H*>(pool);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) p[slot[t] * n + i] = H(static_cast<float>(src[t * stride + i]));
}

// Rows t of `src` (KVH heads of D elements, `stride` apart) as int8 codes and a float16 scale per head, the
// arithmetic of QuantizedKVCacheLayer._quant to the bit: s = max(amax / 127, 1e-8) rounded to float16, then
// code = round-half-even(x / s) clamped to +-127. The build is -ffast-math: the divisors pass through an empty asm so
// that the compiler keeps true divisions (no reciprocal), as PyTorch computes them.
template <class E>
void store_int8(const torch::Tensor& pool, const torch::Tensor& scales, const int64_t* slot, const E* src, int64_t T, int64_t stride,
                int64_t KVH, int64_t D) {
  int8_t* p = static_cast<int8_t*>(pool.data_ptr());
  c10::Half* sp = scales.data_ptr<c10::Half>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const E* x = src + t * stride + h * D;
      float amax = 0.f;
      for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
      float d127 = 127.f;
      asm volatile("" : "+x"(d127));
      const c10::Half hs(std::max(amax / d127, 1e-8f));
      float s = static_cast<float>(hs);
      asm volatile("" : "+x"(s));
      sp[slot[t] * KVH + h] = hs;
      int8_t* out = p + (slot[t] * KVH + h) * D;
      for (int64_t i = 0; i < D; ++i) {
        float v = static_cast<float>(x[i]);
        asm volatile("" : "+x"(v));
        out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v / s))));
      }
    }
}

// Rows t of `src` (n elements each, `stride` apart) as fp8 (e4m3) codes under one scale, the arithmetic of
// QuantizedKVCacheLayer._quant to the bit: code = e4m3(clamp(x / scale, +-448)), rounded to nearest even as
// `Tensor.to(torch.float8_e4m3fn)` rounds. (A true division: the divisor passes through an empty asm, as in store_int8.)
template <class E>
void store_fp8(const torch::Tensor& pool, float scale, const int64_t* slot, const E* src, int64_t T, int64_t stride, int64_t n) {
  uint8_t* p = static_cast<uint8_t*>(pool.data_ptr());
  asm volatile("" : "+x"(scale));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) {
      float v = static_cast<float>(src[t * stride + i]);
      asm volatile("" : "+x"(v));
      p[slot[t] * n + i] = c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, v / scale))).x;
    }
}

template <class E>
void store_rows(const torch::Tensor& pool, const int64_t* slot, const E* src, int64_t T, int64_t stride, int64_t n) {
  if (pool.scalar_type() == at::kHalf) store_rounded<c10::Half>(pool.data_ptr(), slot, src, T, stride, n);
  else store_rounded<c10::BFloat16>(pool.data_ptr(), slot, src, T, stride, n);
}

}  // namespace

torch::Tensor NativeDecoder::forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, int64_t num_decodes,
                                     c10::optional<torch::Tensor> decode_tables, c10::optional<torch::Tensor> decode_lens,
                                     std::vector<int64_t> chunk_starts, std::vector<int64_t> chunk_lens, std::vector<int64_t> chunk_ctx,
                                     std::vector<torch::Tensor> chunk_tables, std::vector<torch::Tensor> k_pools,
                                     std::vector<torch::Tensor> v_pools, std::vector<torch::Tensor> k_scales,
                                     std::vector<torch::Tensor> v_scales, std::vector<int64_t> aux_layers,
                                     c10::optional<torch::Tensor> aux, std::vector<int64_t> tap_rows,
                                     c10::optional<torch::Tensor> taps, std::vector<std::shared_ptr<NativeLoRA>> loras,
                                     std::vector<int64_t> lora_spans, std::shared_ptr<LayerReads> reads) const {
  TORCH_CHECK(x.scalar_type() == dtype, "x must be ", c10::toString(dtype), " like the model's norms");
  TORCH_CHECK(aux_layers.empty() == !aux.has_value(), "aux layers and their output tensor come together");
  for (int64_t l : aux_layers) TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(layers.size()), "aux layer ", l, " out of range");
  TORCH_CHECK(!aux.has_value() || (aux->scalar_type() == dtype && aux->is_contiguous() && aux->dim() == 2 &&
                                   aux->size(0) == x.size(0) &&
                                   aux->size(1) == static_cast<int64_t>(aux_layers.size()) * x.size(1)),
              "aux must be contiguous [T, len(aux_layers) * hidden] of the model's dtype");
  TORCH_CHECK(tap_rows.empty() == !taps.has_value(), "tap rows and their output tensor come together");
  for (int64_t r : tap_rows) TORCH_CHECK(r >= 0 && r < x.size(0), "tap row ", r, " out of range");
  TORCH_CHECK(!taps.has_value() || (taps->scalar_type() == dtype && taps->is_contiguous() && taps->dim() == 3 &&
                                    taps->size(0) == static_cast<int64_t>(layers.size()) &&
                                    taps->size(1) == static_cast<int64_t>(tap_rows.size()) && taps->size(2) == H * D),
              "taps must be contiguous [layers, len(tap_rows), heads * head_dim] of the model's dtype");
  TORCH_CHECK(lora_spans.size() % 3 == 0, "LoRA spans come as (adapter, first row, end row) triples");
  for (size_t i = 0; i < lora_spans.size(); i += 3)
    TORCH_CHECK(lora_spans[i] >= 0 && lora_spans[i] < static_cast<int64_t>(loras.size()) && 0 <= lora_spans[i + 1] &&
                lora_spans[i + 1] <= lora_spans[i + 2] && lora_spans[i + 2] <= x.size(0), "LoRA span out of range");
  for (const auto& lora : loras) {
    TORCH_CHECK(lora && lora->num_layers() == static_cast<int64_t>(layers.size()), "a LoRA adapter must have one entry per layer");
    TORCH_CHECK(lora->takes(dtype), "LoRA weights must be float32 or bf16 (bf16 activations: bf16)");
  }
  if (reads) {
    const size_t L = layers.size(), chunks = chunk_starts.size();
    TORCH_CHECK(reads->k.size() == L && reads->v.size() == L && reads->decode_tables.size() == (num_decodes ? L : 0) &&
                    reads->decode_lens.size() == reads->decode_tables.size() && reads->chunk_tables.size() == L * chunks &&
                    reads->chunk_ctx.size() == L * chunks && (k_scales.empty() || k_scales[0].numel() == 1 ||
                                                              (reads->k_scales.size() == L && reads->v_scales.size() == L)),
                "layer reads: per layer a K and V pool (int8: and scales) and its decode tables and lengths, per layer and "
                "chunk a table and a context length");
    for (size_t l = 0; l < reads->decode_tables.size(); ++l)
      TORCH_CHECK(reads->decode_tables[l].scalar_type() == at::kLong && reads->decode_tables[l].is_contiguous() &&
                      reads->decode_tables[l].size(0) == num_decodes && reads->decode_lens[l].scalar_type() == at::kLong &&
                      reads->decode_lens[l].is_contiguous() && reads->decode_lens[l].numel() == num_decodes,
                  "layer reads: decode tables [decodes, blocks] and lengths [decodes], int64");
  }
  if (dtype == at::kFloat)
    return run<float>(x, positions, slots, num_decodes, decode_tables, decode_lens, chunk_starts, chunk_lens, chunk_ctx, chunk_tables,
                      k_pools, v_pools, k_scales, v_scales, aux_layers, aux, tap_rows, taps, loras, lora_spans, reads.get());
  return run<bf16>(x, positions, slots, num_decodes, decode_tables, decode_lens, chunk_starts, chunk_lens, chunk_ctx, chunk_tables,
                   k_pools, v_pools, k_scales, v_scales, aux_layers, aux, tap_rows, taps, loras, lora_spans, reads.get());
}

template <class E>
torch::Tensor NativeDecoder::run(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, int64_t num_decodes,
                                 c10::optional<torch::Tensor> decode_tables, c10::optional<torch::Tensor> decode_lens,
                                 std::vector<int64_t> chunk_starts, std::vector<int64_t> chunk_lens, std::vector<int64_t> chunk_ctx,
                                 std::vector<torch::Tensor> chunk_tables, std::vector<torch::Tensor> k_pools,
                                 std::vector<torch::Tensor> v_pools, const std::vector<torch::Tensor>& k_scales,
                                 const std::vector<torch::Tensor>& v_scales, const std::vector<int64_t>& aux_layers,
                                 const c10::optional<torch::Tensor>& aux, const std::vector<int64_t>& tap_rows,
                                 const c10::optional<torch::Tensor>& taps, const std::vector<std::shared_ptr<NativeLoRA>>& loras,
                                 const std::vector<int64_t>& lora_spans, const LayerReads* reads) const {
  TORCH_CHECK(k_pools.size() == layers.size() && v_pools.size() == layers.size(), "one K and one V pool per layer");
  TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
  const int64_t T = x.size(0), hid = x.size(1), qs = H * D, kvs = KVH * D, width = qs + 2 * kvs;
  const size_t chunks = chunk_starts.size();
  TORCH_CHECK(chunk_lens.size() == chunks && chunk_ctx.size() == chunks && chunk_tables.size() == chunks, "chunk lists differ in length");
  TORCH_CHECK(num_decodes == 0 || (decode_tables.has_value() && decode_lens.has_value()), "decodes need block tables and lengths");
  TORCH_CHECK(positions.numel() == T && slots.numel() == T, "one position and one slot per token");
  const int64_t* pos = contiguous_ptr<int64_t>(positions, at::kLong, "positions");
  const int64_t* slot = contiguous_ptr<int64_t>(slots, at::kLong, "slots");
  const int64_t* tables = num_decodes ? contiguous_ptr<int64_t>(*decode_tables, at::kLong, "decode block tables") : nullptr;
  const int64_t* lens = num_decodes ? contiguous_ptr<int64_t>(*decode_lens, at::kLong, "decode lengths") : nullptr;
  const int64_t max_blocks = num_decodes ? decode_tables->size(1) : 0;
  const int64_t block_size = k_pools[0].size(1);
  const at::ScalarType kv = k_pools[0].scalar_type();
  const bool int8 = kv == at::kChar, fp8 = kv == at::kFloat8_e4m3fn;
  TORCH_CHECK(kv == dtype || kv == at::kBFloat16 || kv == at::kHalf || int8 || fp8,
              "K/V pools hold the model's dtype, bf16, float16, fp8 or int8 codes");
  TORCH_CHECK(!(int8 || fp8) || (k_scales.size() == layers.size() && v_scales.size() == layers.size()),
              "an int8 or fp8 K/V pool needs its scales, one K and one V tensor per layer");
  std::vector<float> k8(layers.size(), 1.f), v8(layers.size(), 1.f);  // fp8: each layer's scales (x = code * scale)
  for (size_t l = 0; l < layers.size(); ++l) {
    TORCH_CHECK(k_pools[l].scalar_type() == kv && v_pools[l].scalar_type() == kv && k_pools[l].is_contiguous() &&
                v_pools[l].is_contiguous() && k_pools[l].size(2) == KVH && k_pools[l].size(3) == D,
                "K/V pools must be [blocks, block_size, kv_heads, head_dim], every one of one dtype");
    TORCH_CHECK(!int8 || (k_scales[l].scalar_type() == at::kHalf && v_scales[l].scalar_type() == at::kHalf &&
                          k_scales[l].is_contiguous() && v_scales[l].is_contiguous() &&
                          k_scales[l].numel() * D == k_pools[l].numel() && v_scales[l].numel() * D == v_pools[l].numel()),
                "int8 K/V scales must be contiguous float16 [blocks, block_size, kv_heads]");
    if (fp8) {
      TORCH_CHECK(k_scales[l].scalar_type() == at::kFloat && k_scales[l].numel() == 1 && v_scales[l].scalar_type() == at::kFloat &&
                  v_scales[l].numel() == 1, "fp8 K/V scales must be one float32 per layer for K and one for V");
      k8[l] = k_scales[l].item<float>();
      v8[l] = v_scales[l].item<float>();
    }
  }
  const bool same_kv = kv == dtype;  // else each step's new K/V rows are converted as they are written
  // Prefill chunks: the decode kernel on the chunk's rows, row i over its ctx - n + 1 + i keys through the chunk's table
  // (tables and lengths built once, for every layer), under float32 activations (any pool) and where it is the faster
  // kernel in bf16 (decode_attention_takes_prefill); else SDPA over the context read back from the pool. Through the
  // decode kernel a row's attention is computed alone, in one order, whatever chunk or step it is in. SDPA sums a row's
  // keys in blocks that follow where the chunk starts, and under float32 activations the last-bit differences grew,
  // through the int4 kernels' bf16-rounded inputs, to logprobs 0.02 apart (SmolLM2, a 242-token prompt in one chunk or
  // in chunks of 100; with int8 activations, other tokens).
  // fp8 / int8 codes under bf16 activations too: SDPA would take a widened copy of the whole context for every chunk
  // of every layer, and PyTorch's CPU SDPA with a mask on top (SmolLM2 under an SLO's small chunks: an FP8 cache's
  // prefill fell to a fraction of the bf16 cache's, its TTFT p99 from 0.5 to 6.7 s at 35 users).
  const bool chunk_kernel = dtype == at::kFloat || int8 || fp8 || (same_kv && decode_attention_takes_prefill(dtype, kv, D));
  std::vector<torch::Tensor> masks(chunks), row_tables(chunks), row_lens(chunks);  // the same for every layer (but with
  auto chunk_rows = [&](size_t c, const torch::Tensor& chunk_table, int64_t ctx) {  // per-layer reads: each layer's)
    if (chunk_kernel) {
      const auto table = chunk_table.to(at::kLong).contiguous();
      row_tables[c] = table.unsqueeze(0).expand({chunk_lens[c], table.numel()}).contiguous();
      row_lens[c] = torch::arange(ctx - chunk_lens[c] + 1, ctx + 1, torch::TensorOptions().dtype(at::kLong));
    } else {
      masks[c] = ctx != chunk_lens[c] ? causal_mask_bottom_right(chunk_lens[c], ctx, x.options()) : torch::Tensor();
    }
  };
  for (size_t c = 0; c < chunks && !reads; ++c) chunk_rows(c, chunk_tables[c], chunk_ctx[c]);

  // every buffer of the step, allocated once
  const int64_t inter = layers.empty() ? 0 : layers[0].gate_up->n / 2;
  auto opts = x.options();
  auto resid = x.contiguous().clone(), h = torch::empty({T, hid}, opts), mlp = torch::empty({T, hid}, opts);
  auto qkv = torch::empty({T, width}, opts), attn = torch::empty({T, qs}, opts), o = torch::empty({T, hid}, opts);
  auto gu = torch::empty({T, 2 * inter}, opts), act = torch::empty({T, inter}, opts);
  torch::Tensor qn, kn;
  if (!layers.empty() && layers[0].q_norm.defined()) {
    qn = torch::empty({T, qs}, opts);
    kn = torch::empty({T, kvs}, opts);
  }
  E *R = resid.data_ptr<E>(), *Hb = h.data_ptr<E>(), *X = mlp.data_ptr<E>(), *QKV = qkv.data_ptr<E>();
  E *A = attn.data_ptr<E>(), *O = o.data_ptr<E>(), *GU = gu.data_ptr<E>(), *ACT = act.data_ptr<E>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t P = cos.size(0);
  const float e = static_cast<float>(eps);
  // each adapter's rows of the step: its low-rank product added to a projection's output (module 0 qkv, 1 o, 2 gate_up, 3 down)
  auto lora = [&](size_t l, int m, const E* in, int64_t in_features, E* out, int64_t out_features) {
    if (!lora_spans.empty()) NativeLoRA::apply_spans<E>(loras, lora_spans, static_cast<int64_t>(l), m, in, in_features, out, out_features);
  };

  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer& L = layers[l];
    if (l == 0) add_rms_norm_into<E>(R, hid, nullptr, L.input_norm.data_ptr<E>(), T, hid, e, Hb);  // residual = x
    else add_rms_norm_into<E>(X, hid, R, L.input_norm.data_ptr<E>(), T, hid, e, Hb);                // residual += x
    L.qkv->forward_into(Hb, T, QKV);
    lora(l, 0, Hb, hid, QKV, width);
    const E *q = QKV, *k = QKV + qs, *v = QKV + qs + kvs;
    int64_t q_stride = width, k_stride = width;
    // KV compression's query statistics: the tapped rows' queries before rotation (after Qwen3's norm)
    auto tap = [&](const E* src, int64_t stride) {
      E* dst = tap_rows.empty() ? nullptr : taps->data_ptr<E>() + static_cast<int64_t>(l * tap_rows.size()) * qs;
      for (size_t j = 0; j < tap_rows.size(); ++j) std::memcpy(dst + j * qs, src + tap_rows[j] * stride, qs * sizeof(E));
    };
    if (!L.q_norm.defined()) {  // rotate q and k together: heads 0 .. H + KVH of each row
      tap(QKV, width);
      rotary_into<E>(QKV, T, H + KVH, width, D, pos, cp, sp, P);
    } else {  // Qwen3: RMSNorm over each head of q and k first
      E *Q = qn.data_ptr<E>(), *K = kn.data_ptr<E>();
      for (int64_t t = 0; t < T; ++t) {
        add_rms_norm_into<E>(QKV + t * width, D, nullptr, L.q_norm.data_ptr<E>(), H, D, e, Q + t * qs);
        add_rms_norm_into<E>(QKV + t * width + qs, D, nullptr, L.k_norm.data_ptr<E>(), KVH, D, e, K + t * kvs);
      }
      tap(Q, qs);
      rotary_into<E>(Q, T, H, qs, D, pos, cp, sp, P);
      rotary_into<E>(K, T, KVH, kvs, D, pos, cp, sp, P);
      q = Q, k = K, q_stride = qs, k_stride = kvs;
    }
    if (same_kv) {
      E* kp = k_pools[l].data_ptr<E>();
      E* vp = v_pools[l].data_ptr<E>();
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(kp + slot[t] * kvs, k + t * k_stride, kvs * sizeof(E));
        std::memcpy(vp + slot[t] * kvs, v + t * width, kvs * sizeof(E));
      }
    } else if (int8) {  // as QuantizedKVCacheLayer.write_kv: codes and a float16 scale per token and head
      store_int8<E>(k_pools[l], k_scales[l], slot, k, T, k_stride, KVH, D);
      store_int8<E>(v_pools[l], v_scales[l], slot, v, T, width, KVH, D);
    } else if (fp8) {  // as QuantizedKVCacheLayer.write_kv: e4m3 codes under the layer's scales
      store_fp8<E>(k_pools[l], k8[l], slot, k, T, k_stride, kvs);
      store_fp8<E>(v_pools[l], v8[l], slot, v, T, width, kvs);
    } else {  // as KVCacheLayer.write_kv: the rows rounded to the pool's 16-bit dtype
      store_rows<E>(k_pools[l], slot, k, T, k_stride, kvs);
      store_rows<E>(v_pools[l], slot, v, T, width, kvs);
    }
    // what this layer reads: the pools it writes, or with per-layer reads its group's pool across planes and its tables
    const torch::Tensor& kr = reads ? reads->k[l] : k_pools[l];
    const torch::Tensor& vr = reads ? reads->v[l] : v_pools[l];
    c10::Half* ks = int8 ? (reads ? reads->k_scales[l] : k_scales[l]).data_ptr<c10::Half>() : nullptr;
    c10::Half* vs = int8 ? (reads ? reads->v_scales[l] : v_scales[l]).data_ptr<c10::Half>() : nullptr;
    if (num_decodes)
      paged_decode_attention_into<E>(q, q_stride, kr.data_ptr(), vr.data_ptr(), kv, block_size, KVH, D,
                                     reads ? reads->decode_tables[l].data_ptr<int64_t>() : tables,
                                     reads ? reads->decode_tables[l].size(1) : max_blocks,
                                     reads ? reads->decode_lens[l].data_ptr<int64_t>() : lens, num_decodes, H, static_cast<float>(scale),
                                     A, ks, vs, k8[l], v8[l]);
    for (size_t c = 0; c < chunks; ++c) {  // prefill chunks: SDPA over the earlier context (read through the table) and the chunk
      const int64_t s = chunk_starts[c], n = chunk_lens[c], ctx = reads ? reads->chunk_ctx[l * chunks + c] : chunk_ctx[c];
      const torch::Tensor& chunk_table = reads ? reads->chunk_tables[l * chunks + c] : chunk_tables[c];
      if (reads) chunk_rows(c, chunk_table, ctx);
      if (chunk_kernel) {
        paged_decode_attention_into<E>(q + s * q_stride, q_stride, kr.data_ptr(), vr.data_ptr(), kv, block_size, KVH, D,
                                       row_tables[c].data_ptr<int64_t>(), row_tables[c].size(1), row_lens[c].data_ptr<int64_t>(), n, H,
                                       static_cast<float>(scale), A + s * qs, ks, vs, k8[l], v8[l]);
        continue;
      }
      auto qc = strided(q + s * q_stride, n, H, D, q_stride).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
      torch::Tensor kc, vc;
      if (ctx == n && same_kv) {  // (a 16-bit cache: the keys as stored, as KVCacheLayer.stores_exactly says)
        kc = strided(k + s * k_stride, n, KVH, D, k_stride);
        vc = strided(v + s * width, n, KVH, D, width);
      } else if (int8) {  // as QuantizedKVCacheLayer.read_kv: codes x their scales, in float32
        const torch::Tensor& ksr = reads ? reads->k_scales[l] : k_scales[l];
        const torch::Tensor& vsr = reads ? reads->v_scales[l] : v_scales[l];
        kc = (kr.index({chunk_table}).flatten(0, 1).to(at::kFloat) *
              ksr.index({chunk_table}).flatten(0, 1).to(at::kFloat).unsqueeze(-1)).to(dtype).narrow(0, 0, ctx);
        vc = (vr.index({chunk_table}).flatten(0, 1).to(at::kFloat) *
              vsr.index({chunk_table}).flatten(0, 1).to(at::kFloat).unsqueeze(-1)).to(dtype).narrow(0, 0, ctx);
      } else if (fp8) {  // as QuantizedKVCacheLayer.read_kv: codes x the layer's scale, in float32 (gathered as bytes)
        kc = (kr.view(at::kByte).index({chunk_table}).view(kv).flatten(0, 1).to(at::kFloat) * k8[l]).to(dtype).narrow(0, 0, ctx);
        vc = (vr.view(at::kByte).index({chunk_table}).view(kv).flatten(0, 1).to(at::kFloat) * v8[l]).to(dtype).narrow(0, 0, ctx);
      } else {
        kc = kr.index({chunk_table}).flatten(0, 1).narrow(0, 0, ctx).to(dtype);
        vc = vr.index({chunk_table}).flatten(0, 1).narrow(0, 0, ctx).to(dtype);
      }
      auto oc = at::scaled_dot_product_attention(qc, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
                                                 masks[c].defined() ? c10::optional<torch::Tensor>(masks[c]) : c10::nullopt, 0.0,
                                                 !masks[c].defined(), scale, true);
      attn.narrow(0, s, n).view({n, H, D}).copy_(oc[0].transpose(0, 1));
    }
    L.o->forward_into(A, T, O);
    lora(l, 1, A, qs, O, hid);
    add_rms_norm_into<E>(O, hid, R, L.post_norm.data_ptr<E>(), T, hid, e, Hb);
    L.gate_up->forward_into(Hb, T, GU);
    lora(l, 2, Hb, hid, GU, 2 * inter);
    silu_mul_into<E>(GU, T, inter, 2 * inter, ACT);
    L.down->forward_into(ACT, T, X);
    lora(l, 3, ACT, inter, X, hid);
    for (size_t j = 0; j < aux_layers.size(); ++j) {  // the stream after layer l (EAGLE-3's features): its MLP output
      if (aux_layers[j] != static_cast<int64_t>(l)) continue;  // added to everything before it, as the next layer adds
      E* dst = aux->data_ptr<E>() + j * hid;
      const int64_t stride = static_cast<int64_t>(aux_layers.size()) * hid;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < hid; ++c)
          dst[t * stride + c] = static_cast<E>(static_cast<float>(R[t * hid + c]) + static_cast<float>(X[t * hid + c]));
    }
  }
  auto out = torch::empty({T, hid}, opts);
  add_rms_norm_into<E>(X, hid, R, final_norm.data_ptr<E>(), T, hid, e, out.data_ptr<E>());
  return out;
}

}  // namespace sieve
