// W8A8 (sieve/quant/w8a8.py): int8 weights with a float32 scale per output row, against activations quantized to
// int8 per row on every call, multiplied as integers with AVX512-VNNI's vpdpbusd. Per row t of x and output n:
//   a_t = max_k |x_tk|,  s_t = a_t / 127,  q_tk = round-half-even(x_tk * (127 / a_t)) in [-127, 127]  (0 where a_t = 0)
//   acc_tn = sum_k q_tk w_nk (int32, exact),  y_tn = (float(acc_tn) * s_t) * c_n (+ bias_n), rounded once to y's dtype
// which is what sieve/quant/w8a8.py computes with exact integer sums, bit for bit (tests/test_w8a8.py).
//
// vpdpbusd multiplies unsigned bytes by signed ones, 4 per 32-bit lane, and adds them to the lane's int32: the
// activations go in as q + 128 (1 .. 255) and the weights as they are, and the 128 * sum_k w_nk this adds is taken
// off at the end (`comp`, computed at load). A lane sums at most 4 x 255 x 127 per step, so K up to ~66k inputs
// cannot overflow. Layout (block_w8a8 in sieve/quant/w8a8.py): for each block of 16 output rows and each quad u of
// inputs, 64 bytes: row r's w[4u .. 4u + 3] in lane r. One broadcast quad of an input row against one such register
// gives 16 outputs' 4 products summed; a tile keeps MR input rows x NB blocks of accumulators in registers.
//
// AVX2 builds (no int8 dot product of unsigned by signed bytes summed into int32): the same layout read as two
// 256-bit halves (rows 0-7, 8-15 of a block), and llama.cpp's sign trick. vpmaddubsw multiplies unsigned bytes by
// signed ones into int16 pairs, saturating: |w| goes in as the unsigned operand and q carries w's sign
// (vpsignb), so each product is q w exactly and a pair at most 2 x 127 x 127 = 32,258 < 32,767; vpmaddwd by ones
// then sums the pairs into int32. The activations stay signed (no + 128, no compensation).
//
// AMX-INT8 (where the CPU has the tiles and Linux grants them): calls of w8a8_amx_rows() rows and more multiply on
// tiles with tdpbusd, the same unsigned-by-signed products: the blocked layout is already a B tile (16 quads of one
// block, 64 bytes each: a 32-bit lane holds one output's 4 consecutive inputs), A is up to 16 rows' 64 codes q + 128
// where quantize_tokens put them, and C's int32 sums are vpdpbusd's, exactly, ended by the same float steps: the
// same bits either way, so the row count at which calls switch is a matter of speed alone.
//
// The generic build has no kernel here; the Python side multiplies there (float64 products, exact) and its kernel
// name says so.
#include "kernels.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace sieve {

namespace {

struct W8A8Args {
  const uint8_t* xq;  // the activations' codes [M, Kp]: q + 128 (VNNI) or q as signed bytes (AVX2)
  int64_t Kp, K4;
  const int8_t* w;
  const int32_t* comp;  // VNNI: 128 x each row's sum, taken off
  const float* scale;
  const float* s;
  const float* bias;
  int64_t n;
  void* y;
  bool f32;
};

// y[m, n0 .. n0 + cnt) = v (+ bias), in y's dtype
inline void store_outputs(const W8A8Args& a, const float* v, int64_t m, int64_t n0, int64_t cnt) {
  for (int64_t i = 0; i < cnt; ++i) {
    const float out = a.bias ? v[i] + a.bias[n0 + i] : v[i];
    if (a.f32) static_cast<float*>(a.y)[m * a.n + n0 + i] = out;
    else static_cast<bf16*>(a.y)[m * a.n + n0 + i] = bf16(out);
  }
}

}  // namespace

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

bool w8a8_native() { return true; }
std::string w8a8_kernel() {
  return w8a8_amx() ? "AMX-INT8 tdpbusd from " + std::to_string(w8a8_amx_rows()) + " rows, AVX512-VNNI vpdpbusd below"
                    : "AVX512-VNNI vpdpbusd";
}

namespace {

// The build runs -ffast-math, which may turn a / b into a * (1 / b) and (a * b) * c into a * (b * c): the divisions and
// the two scalings use the explicit-rounding forms, which it leaves as written (the bits of sieve/quant/w8a8.py).
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline float div_exact(float a, float b) { return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), kRound)); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Rows of x -> bytes q + 128 [M, Kp] (the padding past K: 128, i.e. q = 0) and scales s [M]
template <class T>
void quantize_tokens(const T* x, int64_t M, int64_t K, int64_t Kp, uint8_t* xq, float* s) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * K;
      uint8_t* qr = xq + m * Kp;
      __m512 vmax = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(xr + k)));
      float amax = _mm512_reduce_max_ps(vmax);
      for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xr[k])));
      const float inv = amax > 0.f ? div_exact(127.0f, amax) : 0.0f;
      s[m] = div_exact(amax, 127.0f);
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
      for (k = 0; k + 16 <= K; k += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_round_ps(load16(xr + k), vinv, kRound));  // round half to even (MXCSR default)
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k), _mm512_cvtepi32_epi8(q));
      }
      for (; k < K; ++k) {
        const float q = std::nearbyint(static_cast<float>(xr[k]) * inv);
        qr[k] = static_cast<uint8_t>(static_cast<int>(std::min(127.f, std::max(-127.f, q))) + 128);
      }
      for (; k < Kp; ++k) qr[k] = 128;
    }
  });
}

// MR rows from m0 against NB blocks blk[0 .. NB): the int32 sums in registers, then both scales, the bias, y's dtype
template <int MR, int NB>
void w8a8_tile(const W8A8Args& a, int64_t m0, const int64_t* blk) {
  __m512i acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* wp[NB];
  for (int j = 0; j < NB; ++j) wp[j] = a.w + blk[j] * a.K4 * 64;
  for (int64_t u = 0; u < a.K4; ++u) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wp[j] + u * 64);
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, a.xq + (m0 + r) * a.Kp + 4 * u, 4);
      const __m512i xv = _mm512_set1_epi32(quad);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = blk[j] * 16, cnt = std::min<int64_t>(16, a.n - n0);
    const __m512i comp = _mm512_loadu_si512(a.comp + n0);
    const __m512 scale = _mm512_loadu_ps(a.scale + n0);
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], comp));
      f = _mm512_mul_round_ps(_mm512_mul_round_ps(f, _mm512_set1_ps(a.s[m]), kRound), scale, kRound);
      alignas(64) float v[16];
      _mm512_store_ps(v, f);
      store_outputs(a, v, m, n0, cnt);
    }
  }
}

// The int32 sums of rows [m0, m0 + rows) against block blk (acc: 16 a row), ended as w8a8_tile ends its own
inline void end_block(const W8A8Args& a, const int32_t* acc, int64_t m0, int64_t rows, int64_t blk) {
  const int64_t n0 = blk * 16, cnt = std::min<int64_t>(16, a.n - n0);
  const __m512i comp = _mm512_loadu_si512(a.comp + n0);
  const __m512 scale = _mm512_loadu_ps(a.scale + n0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + r * 16), comp));
    f = _mm512_mul_round_ps(_mm512_mul_round_ps(f, _mm512_set1_ps(a.s[m]), kRound), scale, kRound);
    alignas(64) float v[16];
    _mm512_store_ps(v, f);
    store_outputs(a, v, m, n0, cnt);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
constexpr bool kHaveAmx = true;
constexpr int kAmxBlocks = 3;  // tiles: 0 = A (up to 16 rows x 64 codes), 1 .. 3 = B of 3 blocks, 4 .. 6 = their C

void load_w8a8_tiles(int64_t rows) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(rows), c.colsb[0] = 64;
  for (int j = 0; j < kAmxBlocks; ++j) {
    c.rows[1 + j] = 16, c.colsb[1 + j] = 64;
    c.rows[4 + j] = static_cast<uint8_t>(rows), c.colsb[4 + j] = 64;
  }
  _tile_loadconfig(&c);
}
// Tile numbers are immediates: block j's B tile is 1 + j, its C 4 + j
template <int j> inline void c_zero() {
  if constexpr (j == 0) _tile_zero(4);
  else if constexpr (j == 1) _tile_zero(5);
  else _tile_zero(6);
}
template <int j> inline void b_multiply(const void* p) {
  if constexpr (j == 0) { _tile_loadd(1, p, 64); _tile_dpbusd(4, 0, 1); }
  else if constexpr (j == 1) { _tile_loadd(2, p, 64); _tile_dpbusd(5, 0, 2); }
  else { _tile_loadd(3, p, 64); _tile_dpbusd(6, 0, 3); }
}
template <int j> inline void c_store(void* p) {
  if constexpr (j == 0) _tile_stored(4, p, 64);
  else if constexpr (j == 1) _tile_stored(5, p, 64);
  else _tile_stored(6, p, 64);
}

// NB blocks against all M rows (xq [Mp, Kp], Mp a multiple of 16 where M > 16), a chunk of 16 rows at a time: every
// 64 inputs one A load and NB tile products, the sums stored and ended per chunk
template <int NB>
void w8a8_amx_tile(const W8A8Args& a, int64_t M, const int64_t (&blk)[NB]) {
  alignas(64) int32_t c[NB][16 * 16];
  const int64_t steps = a.K4 / 16;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    for_tiles<NB>([&]<int j>() { c_zero<j>(); });
    for (int64_t t = 0; t < steps; ++t) {
      _tile_loadd(0, a.xq + m0 * a.Kp + t * 64, a.Kp);
      for_tiles<NB>([&]<int j>() { b_multiply<j>(a.w + (blk[j] * a.K4 + t * 16) * 64); });
    }
    for_tiles<NB>([&]<int j>() { c_store<j>(c[j]); });
    for (int j = 0; j < NB; ++j) end_block(a, c[j], m0, std::min<int64_t>(16, M - m0), blk[j]);
  }
}

void w8a8_amx(const W8A8Args& a, int64_t M, int64_t blocks) {
  // as sweep (kernels.h): a thread walks kAmxBlocks parts of its share side by side, one read stream each
  at::parallel_for(0, blocks, kAmxBlocks, [&](int64_t b0, int64_t b1) {
    load_w8a8_tiles(std::min<int64_t>(M, 16));
    const int64_t part = (b1 - b0) / kAmxBlocks;
    for (int64_t i = 0; i < part; ++i) {
      int64_t blk[kAmxBlocks];
      for (int j = 0; j < kAmxBlocks; ++j) blk[j] = b0 + j * part + i;
      w8a8_amx_tile<kAmxBlocks>(a, M, blk);
    }
    for (int64_t b = b0 + kAmxBlocks * part; b < b1; ++b) {
      const int64_t one[1] = {b};
      w8a8_amx_tile<1>(a, M, one);
    }
    _tile_release();
  });
}
#else
constexpr bool kHaveAmx = false;
void w8a8_amx(const W8A8Args&, int64_t, int64_t) {}
#endif

// Whether calls of w8a8_amx_rows() rows and more take the tiles (-1: not decided; asking Linux is done once)
std::atomic<int> amx_on{-1};
// From this many rows the tiles are faster than vpdpbusd. Intel Xeon (AMX) host, 2 threads, SmolLM2's four shapes
// (1536x576, 576x1536, 576x576, 192x576), vpdpbusd against the tiles: 4 rows 0.84-1.13x, 8 rows 1.14-1.95x,
// 16 rows 1.23-2.39x, 32 rows 1.57-2.37x, 512 rows 1.56-2.35x.
constexpr int64_t kAmxFromRows = 8;
std::atomic<int64_t> amx_from_rows{kAmxFromRows};

bool amx_chosen() {
  int mode = amx_on.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char* env = std::getenv("SIEVE_W8A8_AMX");
    int expected = -1;
    amx_on.compare_exchange_strong(expected, kHaveAmx && !(env && std::string(env) == "0") && amx_permitted() ? 1 : 0);
    mode = amx_on.load();
  }
  return mode == 1;
}

}  // namespace

bool w8a8_amx() { return amx_chosen(); }
bool set_w8a8_amx(bool on) {
  const bool before = amx_chosen();
  TORCH_CHECK(!on || (kHaveAmx && amx_permitted()), "W8A8 on AMX: this build or CPU has no AMX-INT8 tiles it may use");
  amx_on.store(on ? 1 : 0);
  return before;
}
int64_t w8a8_amx_rows() { return amx_from_rows.load(); }
int64_t set_w8a8_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "W8A8 AMX rows: at least 1, not ", rows);
  return amx_from_rows.exchange(rows);
}

void w8a8_into(const void* x, bool f32, int64_t M, int64_t K, const int8_t* w, int64_t blocks, int64_t K4, const int32_t* comp,
               const float* scale, const float* bias, int64_t n, void* y) {
  if (M == 0) return;
  const int64_t Kp = K4 * 4;
  const bool tiles = K4 % 16 == 0 && M >= amx_from_rows.load(std::memory_order_relaxed) && amx_chosen();
  std::vector<uint8_t> xq((tiles ? (M + 15) / 16 * 16 : M) * Kp, 128);  // whole tiles of rows: the padding is q = 0
  std::vector<float> s(M);
  if (f32) quantize_tokens(static_cast<const float*>(x), M, K, Kp, xq.data(), s.data());
  else quantize_tokens(static_cast<const bf16*>(x), M, K, Kp, xq.data(), s.data());
  const W8A8Args a{xq.data(), Kp, K4, w, comp, scale, s.data(), bias, n, y, f32};
  if (tiles) return w8a8_amx(a, M, blocks);
  sweep<6, 2>(M, blocks, [&]<int MR, int NB>(int64_t m0, const int64_t* blk) { w8a8_tile<MR, NB>(a, m0, blk); });
}

#elif defined(__AVX2__)

bool w8a8_native() { return true; }
std::string w8a8_kernel() { return "AVX2 vpmaddubsw"; }

namespace {

// -ffast-math may turn a / b into a * (1 / b) and (a * b) * c into a * (b * c): the division is the divss
// instruction's builtin, and a barrier between the two scalings keeps their order (the bits of sieve/quant/w8a8.py).
inline float div_exact(float a, float b) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b))); }
inline __m256 keep(__m256 v) {
  asm volatile("" : "+x"(v));
  return v;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Rows of x -> signed codes q [M, Kp] (the padding past K: 0) and scales s [M]
template <class T>
void quantize_tokens(const T* x, int64_t M, int64_t K, int64_t Kp, int8_t* xq, float* s) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * K;
      int8_t* qr = xq + m * Kp;
      __m256 vmax = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8(xr + k)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      float amax = 0.f;
      for (float v : lanes) amax = std::max(amax, v);
      for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xr[k])));
      const float inv = amax > 0.f ? div_exact(127.0f, amax) : 0.0f;
      s[m] = div_exact(amax, 127.0f);
      const __m256 vinv = _mm256_set1_ps(inv);
      const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
      for (k = 0; k + 8 <= K; k += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xr + k), vinv));  // round half to even (MXCSR default)
        q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
        alignas(32) int32_t v[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(v), q);
        for (int i = 0; i < 8; ++i) qr[k + i] = static_cast<int8_t>(v[i]);
      }
      for (; k < K; ++k) qr[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(xr[k]) * inv))));
      for (; k < Kp; ++k) qr[k] = 0;
    }
  });
}

// MR rows from m0 against NB blocks (each two halves of 8 rows): int32 sums in registers, then both scales, the bias
template <int MR, int NB>
void w8a8_tile(const W8A8Args& a, int64_t m0, const int64_t* blk) {
  __m256i acc[MR][2 * NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * NB; ++j) acc[r][j] = _mm256_setzero_si256();
  const int8_t* wp[NB];
  for (int j = 0; j < NB; ++j) wp[j] = a.w + blk[j] * a.K4 * 64;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t u = 0; u < a.K4; ++u) {
    __m256i wv[2 * NB], aw[2 * NB];
    for (int j = 0; j < 2 * NB; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[j / 2] + u * 64 + 32 * (j % 2)));
      aw[j] = _mm256_sign_epi8(wv[j], wv[j]);  // |w|
    }
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, a.xq + (m0 + r) * a.Kp + 4 * u, 4);
      const __m256i xv = _mm256_set1_epi32(quad);
      for (int j = 0; j < 2 * NB; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, wv[j]));
        acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int j = 0; j < 2 * NB; ++j) {
    const int64_t n0 = blk[j / 2] * 16 + 8 * (j % 2);
    if (n0 >= a.n) continue;
    const int64_t cnt = std::min<int64_t>(8, a.n - n0);
    const __m256 scale = _mm256_loadu_ps(a.scale + n0);
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const __m256 f = _mm256_mul_ps(keep(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][j]), _mm256_set1_ps(a.s[m]))), scale);
      alignas(32) float v[8];
      _mm256_store_ps(v, f);
      store_outputs(a, v, m, n0, cnt);
    }
  }
}

}  // namespace

void w8a8_into(const void* x, bool f32, int64_t M, int64_t K, const int8_t* w, int64_t blocks, int64_t K4, const int32_t*,
               const float* scale, const float* bias, int64_t n, void* y) {
  if (M == 0) return;
  const int64_t Kp = K4 * 4;
  std::vector<int8_t> xq(M * Kp);
  std::vector<float> s(M);
  if (f32) quantize_tokens(static_cast<const float*>(x), M, K, Kp, xq.data(), s.data());
  else quantize_tokens(static_cast<const bf16*>(x), M, K, Kp, xq.data(), s.data());
  const W8A8Args a{reinterpret_cast<const uint8_t*>(xq.data()), Kp, K4, w, nullptr, scale, s.data(), bias, n, y, f32};
  sweep<4, 1>(M, blocks, [&]<int MR, int NB>(int64_t m0, const int64_t* blk) { w8a8_tile<MR, NB>(a, m0, blk); });
}

#else

bool w8a8_native() { return false; }
std::string w8a8_kernel() { return ""; }

void w8a8_into(const void*, bool, int64_t, int64_t, const int8_t*, int64_t, int64_t, const int32_t*, const float*, const float*,
               int64_t, void*) {
  TORCH_CHECK(false, "this CPU build (", SIEVE_ISA, ") has no W8A8 kernel: W8A8 runs in Python (sieve/quant/w8a8.py)");
}

#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))  // the tiles come with the VNNI kernel
bool w8a8_amx() { return false; }
bool set_w8a8_amx(bool on) {
  TORCH_CHECK(!on, "W8A8 on AMX: this build has no AMX-INT8 kernel");
  return false;
}
int64_t w8a8_amx_rows() { return 0; }
int64_t set_w8a8_amx_rows(int64_t) { return 0; }
#endif

// w [blocks, K4, 64] int8 (block_w8a8), comp int32 and scale float32 [blocks * 16], bias [n] or none; x [M, K <= 4 K4]
// bf16 or float32; returns [M, n] in x's dtype
torch::Tensor w8a8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor comp, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                          int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.size(2) == 64 && w.is_contiguous(), "w8a8_matmul takes blocked int8 [N/16, K/4, 64]");
  const int64_t blocks = w.size(0), K4 = w.size(1);
  TORCH_CHECK(n <= blocks * 16 && comp.scalar_type() == at::kInt && comp.numel() == blocks * 16 && scale.scalar_type() == at::kFloat &&
              scale.numel() == blocks * 16, "w8a8_matmul: comp int32 and scale float32 [N/16 * 16]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= K4 * 4 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or float32 [M, K] with K <= ", K4 * 4);
  auto xc = x.contiguous();
  auto cc = comp.contiguous();
  auto sc = scale.contiguous();
  torch::Tensor bkeep;
  const float* bp = bias_pointer(bias, n, bkeep);
  auto y = torch::empty({xc.size(0), n}, x.options());
  w8a8_into(xc.data_ptr(), xc.scalar_type() == at::kFloat, xc.size(0), xc.size(1), w.data_ptr<int8_t>(), blocks, K4,
            cc.data_ptr<int32_t>(), sc.data_ptr<float>(), bp, n, y.data_ptr());
  return y;
}

}  // namespace sieve
