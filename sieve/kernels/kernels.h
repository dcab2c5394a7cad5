// The native CPU kernels sieve builds on first use (sieve/kernels/__init__.py), declared for module.cpp.
#pragma once
#include <torch/extension.h>

// Which instruction set this build's kernels use (SIEVE_CPU_ISA picks it, see __init__.py): the
// AVX512-BF16 kernels (gemv.cpp, qmatmul.cpp), the AVX2 + FMA + F16C ones (gemv_avx2.cpp,
// qmatmul_avx2.cpp), or none (generic: no native linear kernels; attention and the layer ops remain).
#if defined(__AVX512BF16__)
#define SIEVE_ISA "avx512-bf16"
#define SIEVE_HAS_QUANT 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIEVE_ISA "avx2"
#define SIEVE_HAS_QUANT 1
#else
#define SIEVE_ISA "generic"
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <cstring>
#include <vector>

namespace sieve {

using bf16 = c10::BFloat16;

// f.template operator()<mr>() for a run-time mr in 1 .. R: the tile sizes a kernel instantiates, R down to 1
template <int R, class F>
inline void with_rows(int64_t mr, const F& f) {
  if constexpr (R > 1) {
    if (mr < R) return with_rows<R - 1>(mr, f);
  }
  f.template operator()<R>();
}

// Runs `tile<MR, NB>(m0, blocks)` over all rows of x and all column blocks. Threads split the column
// blocks; a thread cuts its share into NB parts and walks them side by side, so that each of its NB
// read streams moves through consecutive memory (adjacent blocks in lockstep defeat the prefetcher:
// 25 GB/s against 47 for int8 at one row, qmatmul.cpp). Each tile is done for all rows of x, kMR rows at a time.
template <int kMR, int NB, class Tile>
void sweep(int64_t M, int64_t blocks, const Tile& tile) {
  auto rows = [&](auto nb, const auto& blk) {
    constexpr int B = decltype(nb)::value;
    for (int64_t m0 = 0; m0 < M; m0 += kMR)
      with_rows<kMR>(std::min<int64_t>(kMR, M - m0), [&]<int MR>() { tile.template operator()<MR, B>(m0, blk); });
  };
  at::parallel_for(0, blocks, NB, [&](int64_t b0, int64_t b1) {
    const int64_t part = (b1 - b0) / NB;
    for (int64_t i = 0; i < part; ++i) {
      int64_t blk[NB];
      for (int j = 0; j < NB; ++j) blk[j] = b0 + j * part + i;
      rows(std::integral_constant<int, NB>{}, blk);
    }
    for (int64_t b = b0 + NB * part; b < b1; ++b) {
      const int64_t one[1] = {b};
      rows(std::integral_constant<int, 1>{}, one);
    }
  });
}

#if defined(__AVX512F__)
// v[t] -> lane t of the result holds the sum of v[t]'s 16 lanes (a transpose-and-add tree: 45 operations
// for 16 sums, where one _mm512_reduce_add_ps each would take ~8 x 16)
inline __m512 hsum16(const __m512 (&v)[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of the pair (x, y)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's partial sums of 4 consecutive inputs
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // 128-bit block L of b[i] holds lane L's partial sums of inputs 4i..4i+3: add the four blocks
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xDD));
}
#endif

// Each kernel has a raw core (`..._into`: pointers in, results written to `out`/`y`, no allocation
// beyond small scratch) that the native layer loop calls, and a tensor wrapper for Python.

// attention.cpp: one query token per sequence against its paged K/V (model dtype, fp8 or int8 codes)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, c10::optional<torch::Tensor> k_scale,
                                     c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> starts);

template <class T>  // q and the output bf16 or float; the pools `kv`: float32, bf16, float16, int8 codes with float16
                   // scales per token and head (k_scales / v_scales, else null), or fp8 (e4m3) codes with one scale per
                   // pool (k_fp8_scale / v_fp8_scale)
void paged_decode_attention_into(const T* q, int64_t q_stride, const void* k_pool, const void* v_pool, at::ScalarType kv,
                                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, const int64_t* tables, int64_t max_blocks,
                                 const int64_t* lens, int64_t num_seqs, int64_t num_heads, float scale, T* out,
                                 const c10::Half* k_scales = nullptr, const c10::Half* v_scales = nullptr,
                                 float k_fp8_scale = 1.f, float v_fp8_scale = 1.f);

// Whether paged_decode_attention_into is the better kernel for a prefill chunk's rows too (a query per position,
// context lengths ctx - n + 1 .. ctx through one table) than SDPA: bf16 queries and pool with AVX512-BF16, where the
// decode kernel multiplies bf16 pairs; PyTorch's CPU flash attention takes ~1 ms a layer for 256 tokens here.
bool decode_attention_takes_prefill(at::ScalarType q, at::ScalarType kv, int64_t head_dim);

// layer_ops.cpp: a decoder layer's small operations, fused; the raw cores take bf16 or float
// add_rms_norm_into: with `residual`, residual += x and out = norm(residual); without, out = norm(x)
template <class T>
void add_rms_norm_into(const T* x, int64_t x_stride, T* residual, const T* w, int64_t rows, int64_t H, float eps, T* out);
template <class T>
void rotary_into(T* qk, int64_t rows, int64_t heads, int64_t row_stride, int64_t D, const int64_t* positions, const float* cos,
                 const float* sin, int64_t P);
template <class T>
void silu_mul_into(const T* gate_up, int64_t rows, int64_t I, int64_t stride, T* out);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps);
void rotary_(torch::Tensor qk, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
// Structured outputs: -inf in logits[rows[i]] wherever bit v of mask[i] (int32 words, LSB first) is 0.
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor mask, torch::Tensor rows);
// rows `ids` of an int8 table with float16 scales per group (GGUF Q8_0), dequantized: an embedding lookup
torch::Tensor dequantize_rows_q8(torch::Tensor q, torch::Tensor scale, torch::Tensor ids, at::ScalarType dtype);

#if defined(SIEVE_HAS_QUANT)
// gemv.cpp / gemv_avx2.cpp: bf16 weights, decode-sized batches. With AVX512-BF16 up to 8 rows, every row's result
// the same whatever the others (above, oneDNN's packed GEMM or gemm_bf16.cpp's panels are faster); AVX2 up to 4.
#if defined(__AVX512BF16__)
constexpr int64_t kGemvMaxRows = 8;
#else
constexpr int64_t kGemvMaxRows = 4;
#endif
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
void gemv_bf16_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const bf16* bias, bf16* y);
#if defined(__AVX2__) && !defined(__AVX512BF16__)
// qmatmul_avx2.cpp: bf16 weights above the GEMV's rows, float32 panels (bias float32 [N] or null)
void gemm_bf16_avx2_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y);
#endif
#if defined(__AVX512BF16__)
// gemm_bf16.cpp: the same above the GEMV's rows where this CPU's vdpbf16ps is slow (use_fma_dots()): float32 FMAs on
// panels of widened weights, faster there than oneDNN's bf16 GEMM (bias float32 [N] or null)
void gemm_bf16_fma_into(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y);
#endif
#if defined(__AVX512BF16__) || defined(__AVX2__)
torch::Tensor gemm_bf16_fma(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);  // the panels above
#endif

// qmatmul.cpp / qmatmul_avx2.cpp: int8 / fp8 / int4 weights in the blocked layouts of sieve/quant/kernels.py, any batch.
// q8: `scale` float32 [n] per row (group 0), or float16 [N/16, G, 16] per group of `group` inputs.
torch::Tensor qmatmul_q8(torch::Tensor x, torch::Tensor w, bool fp8, torch::Tensor scale, int64_t group,
                         c10::optional<torch::Tensor> bias, int64_t n);
torch::Tensor qmatmul_int4(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> min, int64_t group,
                           c10::optional<torch::Tensor> bias, int64_t n, bool q8_activations);
// x and y: bf16, or float32 where `f32` (x is rounded to bf16 for the dot products, y is written in float32)
void qmatmul_q8_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2, bool fp8,
                     const float* row_scale, const c10::Half* gscale, int64_t group, const float* bias, int64_t n, void* y);
void qmatmul_int4_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2,
                       const c10::Half* scale, const c10::Half* min, int64_t group, const float* bias, int64_t n, void* y);
// Several rows' bf16 dot products in the int4 / int8 tiles as vdpbf16ps ("dpbf16") or as the two float32 FMAs the
// instruction is defined as ("fma": the same bits, faster where vdpbf16ps is slow). The default is "fma" where this
// CPU gives the same bits both ways and the FMAs are faster; the setter (for tests) returns the one before.
#if defined(__AVX512BF16__)
bool use_fma_dots();  // whether the int4 / int8 tiles of 2 or more rows take the FMA form now
// DAZ and FTZ for the life of the object (on the thread that makes it): the FMAs then treat denormal inputs and
// results as vdpbf16ps does
struct FlushDenormals {
  unsigned before = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(before | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(before); }
};
std::string bf16_dot_kernel();
// From how many rows the int4 / int8 kernels run on float32 panels of the weights ("int4", "q8_0": int8 with group
// scales, "int8": per channel, "fp8"; 0: never)
int64_t quantized_panel_rows(const std::string& kind);
bool bf16_dot_fma_exact();
std::string set_bf16_dot_kernel(const std::string& name);
// Whether int4 weights multiply on AMX tiles (qmatmul.cpp), and turning that off or on (tests); returns the setting before
bool use_int4_amx();
bool set_int4_amx(bool on);
// On the tiles, from how many rows a call takes them (int4_amx_rows: fewer rows run FMAs in the tiles' own order, the
// same bits); set_int4_amx_rows (1 .. 4096, tests and benchmarks) returns the count before
int64_t int4_amx_rows();
int64_t set_int4_amx_rows(int64_t rows);
#endif
#if defined(__AMX_TILE__)
// AMX tiles (qmatmul.cpp, qmatmul_q8act.cpp): a thread's tile shapes (palette 1), and whether Linux grants this process
// the tile registers (asked once)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif
bool amx_permitted();  // false in a build without AMX
// The rows of x [M, K2] for tile kernels of 16 rows: as they are up to 16 rows or in whole tiles, else a copy padded
// with zero rows to whole tiles
template <class T>
const T* whole_tiles(const T* x, int64_t M, int64_t K2, std::vector<T>& padded) {
  if (M <= 16 || M % 16 == 0) return x;
  padded.assign((M + 15) / 16 * 16 * K2, T(0));
  std::memcpy(padded.data(), x, M * K2 * sizeof(T));
  return padded.data();
}
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// The int8 tile kernels' shapes (qmatmul_q8act.cpp, greedy_head.cpp): tile 0 = A (up to 16 rows of one block's 32 int8
// codes), 1 .. 3 = B of 3 blocks of 16 outputs (8 rows of 64 bytes: a 32-bit lane holds one output's 4 consecutive
// inputs), 4 .. 6 = their C (16 int32 sums a row)
inline void load_int8_tiles(int64_t rows) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(rows), c.colsb[0] = 32;
  for (int j = 0; j < 3; ++j) {
    c.rows[1 + j] = 8, c.colsb[1 + j] = 64;
    c.rows[4 + j] = static_cast<uint8_t>(rows), c.colsb[4 + j] = 64;
  }
  _tile_loadconfig(&c);
}
// C_j = A B_j from zero: signed A against unsigned (tdpbsud) or signed (tdpbssd) B. Tile numbers are immediates.
template <int j, bool kSignedB>
inline void int8_tile_product(const void* btile) {
  if constexpr (j == 0) { _tile_zero(4); _tile_loadd(1, btile, 64); if constexpr (kSignedB) _tile_dpbssd(4, 0, 1); else _tile_dpbsud(4, 0, 1); }
  else if constexpr (j == 1) { _tile_zero(5); _tile_loadd(2, btile, 64); if constexpr (kSignedB) _tile_dpbssd(5, 0, 2); else _tile_dpbsud(5, 0, 2); }
  else { _tile_zero(6); _tile_loadd(3, btile, 64); if constexpr (kSignedB) _tile_dpbssd(6, 0, 3); else _tile_dpbsud(6, 0, 3); }
}
template <int j>
inline void int8_tile_store(void* p) {  // C_j's rows, 64 bytes apart
  if constexpr (j == 0) _tile_stored(4, p, 64);
  else if constexpr (j == 1) _tile_stored(5, p, 64);
  else _tile_stored(6, p, 64);
}
// Their pipeline over `steps` blocks of 32 inputs, all M rows of A (xq [Mp, K2], Mp a multiple of 16 where M > 16):
// decode(s, bt) writes step s's NB B tiles (uint8_t bt[NB][512]) two steps ahead into a ring; each step multiplies every
// 16-row chunk of A by them into cbuf half s & 1 ([NB][Mp][16] int32), and end(s - 1, c) ends the step before from
// its sums. So no tile load waits on stores just made, and no float step on a tile store just made.
template <int NB, bool kSignedB, class Decode, class End>
inline void int8_tile_pipeline(const int8_t* xq, int64_t K2, int64_t M, int64_t steps, int32_t* cbuf, const Decode& decode,
                               const End& end) {
  constexpr int kAhead = 2, kRing = kAhead + 1;
  alignas(64) uint8_t ring[kRing][NB][8 * 64];
  const int64_t chunks = (M + 15) / 16, half = NB * chunks * 16 * 16;
  for (int64_t s = 0; s < std::min<int64_t>(kAhead, steps); ++s) decode(s, ring[s % kRing]);
  for (int64_t s = 0; s < steps; ++s) {
    if (s + kAhead < steps) decode(s + kAhead, ring[(s + kAhead) % kRing]);
    const auto& bt = ring[s % kRing];
    int32_t* c = cbuf + (s & 1) * half;
    for (int64_t h = 0; h < chunks; ++h) {
      _tile_loadd(0, xq + h * 16 * K2 + s * 32, K2);
      for_tiles<NB>([&]<int j>() { int8_tile_product<j, kSignedB>(bt[j]); });
      for_tiles<NB>([&]<int j>() { int8_tile_store<j>(c + (j * chunks + h) * 16 * 16); });
    }
    if (s > 0) end(s - 1, cbuf + ((s - 1) & 1) * half);
  }
  end(steps - 1, cbuf + ((steps - 1) & 1) * half);
}
#endif
// f.template operator()<b>() for b = 0 .. NB - 1: a tile kernel's per-block steps, whose tile numbers are immediates
template <int NB, class F>
inline void for_tiles(const F& f) {
  [&]<int... b>(std::integer_sequence<int, b...>) { (f.template operator()<b>(), ...); }(std::make_integer_sequence<int, NB>{});
}
// qmatmul_q8act.cpp: the same int4 weights against int8 activations quantized per row and 32 inputs (AVX2 integer
// dot products in both builds, or AVX512-VNNI's vpdpbusd where the build has it: the same bits); group a multiple of 32
void qmatmul_int4_q8act_into(const void* x, bool f32, int64_t M, int64_t K, const uint8_t* w, int64_t blocks, int64_t K2,
                             const c10::Half* scale, const c10::Half* min, int64_t group, const float* bias, int64_t n, void* y);
// The rows it multiplies, quantized (quantize_rows, the same function for the Q8_0 greedy head): per block of 32 inputs
// the scale d and the float32 sum of x, the codes q (zero past K), and for the AVX2 kernel (`pairs`) per unit u of 4
// inputs two broadcastable words (q_4u, q_4u+1) x 2 and (q_4u+2, q_4u+3) x 2
struct Q8Rows {
  int64_t units = 0, nb = 0;
  std::vector<int32_t> pairs;  // [M, units, 2]
  std::vector<int8_t> q;       // [M, K2]: the codes themselves (a unit's quad is one 32-bit word)
  std::vector<float> d, xs;    // [M, nb]
};
Q8Rows quantize_rows(const void* x, bool f32, int64_t M, int64_t K, int64_t K2, bool pairs);  // x bf16 or float32 [M, K]
// which of its inner kernels runs: "amx-int8" (tiles from q8act_amx_rows() rows, vpdpbusd below), "avx512-vnni" or "avx2"
// (the best the build and CPU allow is the default); the setter returns the one before (for tests that check they give the
// same bits)
std::string q8act_kernel();
std::string set_q8act_kernel(const std::string& name);
// Under "amx-int8" (AMX-INT8 tiles, where the CPU has them and Linux grants them: the default there), calls of at least
// this many rows go to the tiles and fewer to vpdpbusd; the same bits either way. The setter returns the value before.
int64_t q8act_amx_rows();
int64_t set_q8act_amx_rows(int64_t rows);
// greedy_head.cpp: the first index of each bf16 row's max over x . w^T, as the GEMV computes them, from an int8
// sketch of w (codes [N, Kp] of at most greedy_head_code_max() in magnitude, zero padded to a multiple of 32; float32
// scales and radii [N]); returns (ids [M], candidates [M]), id -1 for a row that is not finite
std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor w, torch::Tensor codes, torch::Tensor scale,
                                                     torch::Tensor radius);
int64_t greedy_head_code_max();
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// the same for a GGUF Q8_0 head (blocked int8 codes [N/16, K/2, 32], float16 scales per 32 inputs) and float32 hidden
// states, from the file's own codes against int8-quantized activations (vpdpbusd) and per-row norms `wnorm` [N]
std::tuple<torch::Tensor, torch::Tensor> greedy_head_q8(torch::Tensor x, torch::Tensor w, torch::Tensor gscale, int64_t group,
                                                        int64_t N, torch::Tensor wnorm);
// The most rows a call takes (64). Where the CPU has AMX-INT8 tiles and Linux grants them, calls of
// greedy_head_q8_amx_rows() rows and more (9 unless set; 1 to 65, for tests that compare the two) multiply the sketch on
// them (tdpbssd: the same integer sums as vpdpbusd, so the same answers); the setter returns the value before.
int64_t greedy_head_q8_max_rows();
int64_t greedy_head_q8_amx_rows();
int64_t set_greedy_head_q8_amx_rows(int64_t rows);
#endif
#endif

// The bias as a kernel reads it: float32, one per output, or null (`keep` holds the float32 copy)
inline const float* bias_pointer(const c10::optional<torch::Tensor>& t, int64_t n, torch::Tensor& keep) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->numel() == n, "bias must have one value per output");
  keep = t->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// w8a8.cpp: int8 weights (blocked [blocks, K4, 64], a float32 scale and an int32 128 * row sum per padded row) against
// int8 activations quantized per row on each call (AVX512-VNNI and AVX2 builds; w8a8_native() says whether this one has
// a kernel, w8a8_kernel() names it)
bool w8a8_native();
std::string w8a8_kernel();
// Whether calls of w8a8_amx_rows() rows and more multiply on AMX-INT8 tiles (where the CPU has them and Linux grants
// them, unless SIEVE_W8A8_AMX=0): the same bits as vpdpbusd. The setters (tests, benchmarks) return the value before.
bool w8a8_amx();
bool set_w8a8_amx(bool on);
int64_t w8a8_amx_rows();
int64_t set_w8a8_amx_rows(int64_t rows);
void w8a8_into(const void* x, bool f32, int64_t M, int64_t K, const int8_t* w, int64_t blocks, int64_t K4, const int32_t* comp,
               const float* scale, const float* bias, int64_t n, void* y);
torch::Tensor w8a8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor comp, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                          int64_t n);

// linear.cpp: a linear layer's weight in a native kernel's layout, callable on any batch
struct NativeLinear {
  enum Kind : int64_t { kBF16 = 0, kQ8 = 1, kInt4 = 2, kW8A8 = 3 };
  int64_t kind, n, group;
  bool fp8;
  int64_t k;  // inputs the layer takes (the blocked layouts may pad them: K2)
  torch::Tensor w, packed, scale, aux;  // aux: int4 mins (undefined: w = (q - 8) s); W8A8: 128 * each row's sum (int32)
  c10::optional<torch::Tensor> bias;
  torch::Tensor bias_bf16, bias_f32;  // the bias as the kernels read it
  // bf16: every batch through the GEMV, kGemvMaxRows rows at a time, so that a row's result never depends on
  // how many rows share the call (oneDNN's GEMM above the GEMV's rows accumulates in another order)
  bool batch_invariant = false;
  // int4: multiply int8 activations (per row and 32 inputs) by the codes (qmatmul_q8act.cpp); lossy, opt-in
  bool q8_activations = false;
  NativeLinear(int64_t kind, torch::Tensor w, c10::optional<torch::Tensor> packed, c10::optional<torch::Tensor> scale,
               c10::optional<torch::Tensor> aux, bool fp8, int64_t group, int64_t n, int64_t k, c10::optional<torch::Tensor> bias);
  torch::Tensor forward(const torch::Tensor& x) const;
  template <class T>  // bf16, or float32 (quantized kinds only)
  void forward_into(const T* x, int64_t M, T* y) const;  // x [M, k], y [M, n], both contiguous
};

// decoder.cpp: the layer loop of one step (bf16 or float32 activations, model-dtype KV cache)
// LoRA (lora.cpp): y[rows] += (x[rows] A^T) B^T in float32 sums, rounded once per output; float32 activations may take
// bf16 weights (half the bytes a step reads of an adapter)
bool lora_dtypes_ok(at::ScalarType activations, at::ScalarType weights);

// One adapter's matrices: per layer, per module (0 qkv, 1 o, 2 gate_up, 3 down), A^T [in, R] and B^T [R, out] with its
// scaling folded in, kept in panels (undefined where it has none)
class NativeLoRA {
 public:
  explicit NativeLoRA(int64_t num_layers);
  void set(int64_t layer, int64_t module, torch::Tensor At, torch::Tensor Bt);
  // y[start:end] += (x[start:end] A^T) B^T for one module (Python's layer loop: the same arithmetic as the C++ one)
  void apply(int64_t layer, int64_t module, torch::Tensor x, torch::Tensor y, int64_t start, int64_t end) const;
  // every span's (adapter index, first row, end row) product for one module of one layer, in two parallel regions
  template <class E>
  static void apply_spans(const std::vector<std::shared_ptr<NativeLoRA>>& loras, const std::vector<int64_t>& spans, int64_t layer,
                          int64_t module, const E* x, int64_t in, E* y, int64_t out);
  bool takes(at::ScalarType activations) const;
  int64_t num_layers() const { return static_cast<int64_t>(mats.size()); }

 private:
  struct Mat {
    torch::Tensor a, b;
    int64_t in = 0, r = 0, out = 0;
  };
  std::vector<std::array<Mat, 4>> mats;
};

// KV compression with per-layer budgets (sieve/kv_compression/cells.py): what each layer reads in a step, where the
// layers keep different counts in blocks packed across the pool's planes. Per layer: the pool it reads (its group's,
// flattened across planes) and int8's scales alike, its decode rows' tables and lengths; per layer and prefill chunk
// (index layer * chunks + chunk), the chunk's context length and table. The step's K/V are written as without it.
struct LayerReads {
  std::vector<torch::Tensor> k, v, k_scales, v_scales, decode_tables, decode_lens, chunk_tables;
  std::vector<int64_t> chunk_ctx;
};

class NativeDecoder {
 public:
  NativeDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, torch::Tensor cos,
                torch::Tensor sin, torch::Tensor final_norm);
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, std::shared_ptr<NativeLinear> qkv, std::shared_ptr<NativeLinear> o,
                 std::shared_ptr<NativeLinear> gate_up, std::shared_ptr<NativeLinear> down);
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, int64_t num_decodes,
                        c10::optional<torch::Tensor> decode_tables, c10::optional<torch::Tensor> decode_lens,
                        std::vector<int64_t> chunk_starts, std::vector<int64_t> chunk_lens, std::vector<int64_t> chunk_ctx,
                        std::vector<torch::Tensor> chunk_tables, std::vector<torch::Tensor> k_pools,
                        std::vector<torch::Tensor> v_pools, std::vector<torch::Tensor> k_scales = {},
                        std::vector<torch::Tensor> v_scales = {}, std::vector<int64_t> aux_layers = {},
                        c10::optional<torch::Tensor> aux = c10::nullopt, std::vector<int64_t> tap_rows = {},
                        c10::optional<torch::Tensor> taps = c10::nullopt,
                        std::vector<std::shared_ptr<NativeLoRA>> loras = {}, std::vector<int64_t> lora_spans = {},
                        std::shared_ptr<LayerReads> reads = nullptr) const;

 private:
  template <class T>
  torch::Tensor run(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, int64_t num_decodes,
                    c10::optional<torch::Tensor> decode_tables, c10::optional<torch::Tensor> decode_lens,
                    std::vector<int64_t> chunk_starts, std::vector<int64_t> chunk_lens, std::vector<int64_t> chunk_ctx,
                    std::vector<torch::Tensor> chunk_tables, std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools,
                    const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                    const std::vector<int64_t>& aux_layers, const c10::optional<torch::Tensor>& aux,
                    const std::vector<int64_t>& tap_rows, const c10::optional<torch::Tensor>& taps,
                    const std::vector<std::shared_ptr<NativeLoRA>>& loras, const std::vector<int64_t>& lora_spans,
                    const LayerReads* reads) const;
  struct Layer {
    torch::Tensor input_norm, post_norm, q_norm, k_norm;
    std::shared_ptr<NativeLinear> qkv, o, gate_up, down;
  };
  int64_t H, KVH, D;
  at::ScalarType dtype;  // of activations, norms and K/V: bf16, or float32 (quantized linears only)
  double eps, scale;
  torch::Tensor cos, sin, final_norm;
  std::vector<Layer> layers;
};

}  // namespace sieve
