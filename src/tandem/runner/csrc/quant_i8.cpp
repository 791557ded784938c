// GGUF Q4_1 linear layers with 8-bit activations, as llama.cpp computes them (Q4_1 weights times
// Q8_1 activations): y = x W^T (+ bias), x and y float32 or both bfloat16, on any CPU with AVX2.
//
// A Q4_1 block holds 32 weights of one row, w = d q + m with q in 0..15. Each call quantizes x per
// row and block of 32 (llama.cpp's Q8_1: dx = max|x| / 127, qx = round(x / dx), sx = dx sum qx), so
//   sum_k w_k x_k ~= d dx sum_k q_k qx_k + m sx
// where sum q qx is an exact integer dot product: VPMADDUBSW multiplies 32 unsigned q by 32 signed
// qx into 16 pair sums, which stay exact when a block's eight of them are added in 16 bits
// (16 x 15 x 127 = 30,480 < 32,767). The only rounding is of x to 8 bits per block (relative error
// ~0.5% per layer, llama.cpp's); weights are never rounded.
//
// Why: on a 2-core AVX2 EPYC a float32 GEMM is bound by its FMAs (8 multiply-adds per
// instruction); VPMADDUBSW does 32. Per block and row the kernel spends 8 VPMADDUBSW, 8 adds and 5
// instructions of scaling on 256 multiply-adds, about half the instructions of float32, and it
// reads 0.625 bytes per weight (GGML's own) instead of 4.
//
// Q8_0 blocks (w = d q, q in -127..127; the default model's tied embeddings / LM head) take x
// rounded the same way, as llama.cpp's Q8_0 x Q8_0 does: VPMADDUBSW needs one unsigned operand, so
// it multiplies |q| by qx carrying q's sign (VPSIGNB), and each vector's pair sums go to 32 bits
// at once (2 x 127 x 127 fits 16 bits, four of them would not).
//
// Q6_K blocks (llama.cpp's K-quant of 6 bits: 256 weights share a float16 d, each 16 of them an
// int8 scale, w = d sc (q - 32) with q in 0..63) run from their own bits, not requantized to Q8_0:
// per 32 weights a record keeps q's low 4 bits as Q4_1's do, its high 2 bits, and the two halves'
// d sc in float16 (the one rounding: d sc to float16), 7 bits per weight instead of Q8_0's 8.5.
// q - 32 lies in -32..31: as with Q8_0, VPMADDUBSW takes |q - 32| and moves the sign to x, and a
// half's four vectors of pair sums stay exact in 16 bits (4 x 2 x 32 x 127 = 32,512). The halves
// (inputs 0..15 and 16..31, the low and high nibbles) keep their own sums, one scale each.
//
// Q4_K blocks (256 weights share a float16 d and dmin, each 32 of them a 6-bit scale and min,
// w = d sc q - dmin m with q in 0..15) run as Q4_1 does, with the block's d sc and -dmin m formed
// in float32 from the file's own fields (4.625 bits a weight in records, where Q4_1 takes 5).
//
// Layout, packed once at load (quant_pack_i8): groups of 8 output rows; per group and block one
// record. Q4_1, 160 bytes: 4 vectors of 32 bytes, vector v holding, for row j of the group, the q of
// inputs 4v..4v+3 (low nibbles) and 16+4v..16+4v+3 (high nibbles) in bytes 4j..4j+3; then the 8
// rows' d and then their m as float16 (the blocks' own bits: GGML's 20 bytes per 32 weights).
// Broadcasting 4 bytes of qx against a vector gives 8 rows' partial dot products at once, lane j
// for row j. Q8_0, 272 bytes: 8 vectors, vector v holding row j's q of
// inputs 4v..4v+3 in bytes 4j..4j+3, then the 8 rows' d as float16. Q6_K, 224 bytes: Q4_1's 4
// vectors of low 4 bits; 2 vectors of high 2 bits, vector u holding in byte 4j+t the bits of
// inputs 8u+t, 16+8u+t, 8u+4+t and 16+8u+4+t (bits 0-1, 2-3, 4-5, 6-7); the 8 rows' d sc of
// inputs 0..15, then of 16..31, as float16. Q4_K, 1,184 bytes per super-block of 256: the 8
// blocks' q as Q4_1 records hold them (8 x 128 bytes), the 8 rows' d and -dmin as float16, then
// per block the 8 rows' 6-bit scales, then mins, a byte each.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_QUANT_I8 1
#endif

namespace {

constexpr int64_t kGroup = 8, kBlock = 32;
constexpr int kQ4_1 = 0, kQ8_0 = 1, kQ6_K = 2, kQ4_K = 3;      // tandem.models.quant (QTYPES, Q6_K_I8, Q4_K_I8)
// Bytes per record: per 32 inputs for Q4_1, Q8_0 and Q6_K; per super-block of 256 for Q4_K.
constexpr int64_t record_bytes(int qtype) {
  return qtype == kQ4_1 ? 160 : qtype == kQ8_0 ? 272 : qtype == kQ6_K ? 224 : 1184;
}
// Bytes of the file's blocks per 32 weights; K-quant super-blocks of 256 take 210 (Q6_K) and 144 (Q4_K).
constexpr int64_t kSuper = 256, kQ6_KBytes = 210, kQ4_KBytes = 144;
constexpr int64_t source_block_bytes(int qtype) { return qtype == kQ4_1 ? 20 : 34; }
constexpr bool valid_qtype(int64_t q) { return q == kQ4_1 || q == kQ8_0 || q == kQ6_K || q == kQ4_K; }
constexpr bool k_quant(int64_t q) { return q == kQ6_K || q == kQ4_K; }
constexpr const char* qtype_name(int64_t q) {
  return q == kQ4_1 ? "Q4_1" : q == kQ8_0 ? "Q8_0" : q == kQ6_K ? "Q6_K" : "Q4_K";
}
// Bytes per row of the file's blocks for K inputs.
constexpr int64_t source_row_bytes(int64_t qtype, int64_t k) {
  return qtype == kQ6_K ? k / kSuper * kQ6_KBytes : qtype == kQ4_K ? k / kSuper * kQ4_KBytes
                        : k / kBlock * source_block_bytes(static_cast<int>(qtype));
}
// Bytes per group of 8 rows of records for K inputs.
constexpr int64_t group_bytes(int qtype, int64_t k) {
  return qtype == kQ4_K ? k / kSuper * record_bytes(qtype) : k / kBlock * record_bytes(qtype);
}
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the record being read
constexpr int64_t kChunkRows = 96;   // rows per pass over the weights: their qx (<= 150 KB) stay in L2

#ifdef TANDEM_QUANT_I8
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {      // bfloat16 is float32's upper half: widen and shift
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void put(float* y, float v) { *y = v; }
inline void put(at::BFloat16* y, float v) { *y = at::BFloat16(v); }     // round to nearest even

// One row of x -> qx (int8), dx and sx per block of 32 (llama.cpp's quantize_row_q8_1).
template <typename X>
void quantize_row(const X* x, int64_t k, int8_t* qx, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const X* p = x + b * kBlock;
    __m256 v0 = load8(p), v1 = load8(p + 8), v2 = load8(p + 16), v3 = load8(p + 24);
    __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    const float amax = hmax8(a), d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 s = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, s), _MM_FROUND_TO_NEAREST_INT)),
                  i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, s), _MM_FROUND_TO_NEAREST_INT)),
                  i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, s), _MM_FROUND_TO_NEAREST_INT)),
                  i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, s), _MM_FROUND_TO_NEAREST_INT));
    dx[b] = d;
    sx[b] = d * static_cast<float>(hsum8i(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3))));
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permutation undoes it
    const __m256i q = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), perm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * kBlock), q);
  }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t t;
  std::memcpy(&t, p, 4);
  return _mm256_set1_epi32(t);
}

// The cache lines kPrefetch bytes past a record: the hardware prefetcher alone leaves the LM head's
// weight stream at 12 GB/s on a 2-core AVX2 EPYC, this takes it past 34.
template <int LINES>
inline void prefetch_ahead(const uint8_t* rec) {
  for (int i = 0; i < LINES; ++i) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + 64 * i), _MM_HINT_T0);
}

template <int MR, typename Y>
inline void store_tile(Y* y, int64_t ldy, __m256 a0, __m256 a1, __m256 a2, __m256 a3, const float* bias,
                       int64_t cols) {
  alignas(32) float t[4][kGroup];
  _mm256_store_ps(t[0], a0); _mm256_store_ps(t[1], a1); _mm256_store_ps(t[2], a2); _mm256_store_ps(t[3], a3);
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) put(y + r * ldy + j, t[r][j] + (bias != nullptr ? bias[j] : 0.f));
}

// MR rows of qx against one block of 4-bit q (128 bytes in Q4_1's record order), w = d q + m, with
// the 8 rows' d and m given: adds to the accumulators.
template <int MR>
inline void block_q4(const uint8_t* q, const int8_t* x0, int64_t k, __m256 d, __m256 m, const float* dx,
                     const float* sx, int64_t nb, __m256& a0, __m256& a1, __m256& a2, __m256& a3) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (int v = 0; v < 4; ++v) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * v));
    const __m256i lo = _mm256_and_si256(wv, low), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
#define TANDEM_I8_ROW(R, S)                                                                         \
    if constexpr (MR > R) {                                                                         \
      S = _mm256_add_epi16(S, _mm256_maddubs_epi16(lo, bcast4(x0 + R * k + 4 * v)));                \
      S = _mm256_add_epi16(S, _mm256_maddubs_epi16(hi, bcast4(x0 + R * k + 16 + 4 * v)));           \
    }
    TANDEM_I8_ROW(0, s0) TANDEM_I8_ROW(1, s1) TANDEM_I8_ROW(2, s2) TANDEM_I8_ROW(3, s3)
#undef TANDEM_I8_ROW
  }
  // With 1 or 2 rows the m terms go to the spare accumulators a2 / a3: two FMA chains per row
  // instead of one twice as long, which at one row would bound the loop at 8 cycles a block.
#define TANDEM_I8_FIN(R, A, C, S)                                                                     \
  if constexpr (MR > R) {                                                                             \
    A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(S, ones)), _mm256_mul_ps(d, _mm256_set1_ps(dx[R * nb])), A); \
    C = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[R * nb]), C);                                            \
  }
  if constexpr (MR <= 2) {
    TANDEM_I8_FIN(0, a0, a2, s0) TANDEM_I8_FIN(1, a1, a3, s1)
  } else {
    TANDEM_I8_FIN(0, a0, a0, s0) TANDEM_I8_FIN(1, a1, a1, s1) TANDEM_I8_FIN(2, a2, a2, s2) TANDEM_I8_FIN(3, a3, a3, s3)
  }
#undef TANDEM_I8_FIN
}

// MR rows of qx against one group's Q4_1 records: 8 outputs per row.
template <int MR, typename Y>
inline void tile_q4_1(Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* sx,
                 const uint8_t* rec, const float* bias, int64_t cols) {
  const int64_t nb = k / kBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nb; ++b, rec += record_bytes(kQ4_1)) {
    prefetch_ahead<3>(rec);     // a 160-byte record spans up to 3 lines
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 128)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 144)));
    block_q4<MR>(rec, qx + b * kBlock, k, d, m, dx + b, sx + b, nb, a0, a1, a2, a3);
  }
  if constexpr (MR <= 2) {
    a0 = _mm256_add_ps(a0, a2);
    a1 = _mm256_add_ps(a1, a3);
  }
  store_tile<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

inline __m256 u8x8(const uint8_t* p) {       // 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// MR rows of qx against one group's Q4_K records (a super-block of 256 inputs each): 8 outputs per row.
template <int MR, typename Y>
inline void tile_q4_k(Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* sx,
                      const uint8_t* rec, const float* bias, int64_t cols) {
  const int64_t nb = k / kBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t sb = 0; sb < k / kSuper; ++sb, rec += record_bytes(kQ4_K)) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 1024)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 1040)));
    for (int t = 0; t < 8; ++t) {
      const int64_t b = sb * 8 + t;
      prefetch_ahead<2>(rec + 128 * t);
      block_q4<MR>(rec + 128 * t, qx + b * kBlock, k, _mm256_mul_ps(d, u8x8(rec + 1056 + 8 * t)),
                   _mm256_mul_ps(dmin, u8x8(rec + 1120 + 8 * t)), dx + b, sx + b, nb, a0, a1, a2, a3);
    }
  }
  if constexpr (MR <= 2) {
    a0 = _mm256_add_ps(a0, a2);
    a1 = _mm256_add_ps(a1, a3);
  }
  store_tile<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

// MR rows of qx against one group's Q8_0 records: 8 outputs per row.
template <int MR, typename Y>
inline void tile_q8_0(Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* /*sx*/,
                      const uint8_t* rec, const float* bias, int64_t cols) {
  const int64_t nb = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nb; ++b, rec += record_bytes(kQ8_0)) {
    const int8_t* x0 = qx + b * kBlock;
    prefetch_ahead<5>(rec);     // 272-byte records straddle up to 5 lines
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int v = 0; v < 8; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * v));
      const __m256i aw = _mm256_abs_epi8(wv);
#define TANDEM_I8_ROW(R, S)                                                                           \
      if constexpr (MR > R) {                                                                         \
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(x0 + R * k + 4 * v), wv)); \
        S = _mm256_add_epi32(S, _mm256_madd_epi16(p, ones));                                          \
      }
      TANDEM_I8_ROW(0, s0) TANDEM_I8_ROW(1, s1) TANDEM_I8_ROW(2, s2) TANDEM_I8_ROW(3, s3)
#undef TANDEM_I8_ROW
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256)));
#define TANDEM_I8_FIN(R, A, S)                                                                        \
    if constexpr (MR > R) A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(dx[R * nb + b])), A);
    TANDEM_I8_FIN(0, a0, s0) TANDEM_I8_FIN(1, a1, s1) TANDEM_I8_FIN(2, a2, s2) TANDEM_I8_FIN(3, a3, s3)
#undef TANDEM_I8_FIN
  }
  store_tile<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

// MR rows of qx against one group's Q6_K records: 8 outputs per row.
template <int MR, typename Y>
inline void tile_q6_k(Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* /*sx*/,
                      const uint8_t* rec, const float* bias, int64_t cols) {
  const int64_t nb = k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32),
                ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nb; ++b, rec += record_bytes(kQ6_K)) {
    const int8_t* x0 = qx + b * kBlock;
    prefetch_ahead<4>(rec);     // a 224-byte record spans up to 4 lines
    __m256i l0 = _mm256_setzero_si256(), l1 = l0, l2 = l0, l3 = l0, h0 = l0, h1 = l0, h2 = l0, h3 = l0;
    for (int v = 0; v < 4; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * v));
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 128 + 32 * (v >> 1)));
      // high 2 bits to bits 4-5: from bits 0-1 / 2-3 (even v) or 4-5 / 6-7 (odd v) of each byte
      const __m256i hl = _mm256_and_si256(v & 1 ? hv : _mm256_slli_epi16(hv, 4), two);
      const __m256i hh = _mm256_and_si256(v & 1 ? _mm256_srli_epi16(hv, 2) : _mm256_slli_epi16(hv, 2), two);
      const __m256i lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(wv, low), hl), off);
      const __m256i hi = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(wv, 4), low), hh), off);
      const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
#define TANDEM_I8_ROW(R, L, H)                                                                               \
      if constexpr (MR > R) {                                                                                \
        L = _mm256_add_epi16(L, _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(x0 + R * k + 4 * v), lo)));  \
        H = _mm256_add_epi16(H, _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(x0 + R * k + 16 + 4 * v), hi))); \
      }
      TANDEM_I8_ROW(0, l0, h0) TANDEM_I8_ROW(1, l1, h1) TANDEM_I8_ROW(2, l2, h2) TANDEM_I8_ROW(3, l3, h3)
#undef TANDEM_I8_ROW
    }
    const __m256 dl = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 192)));
    const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 208)));
#define TANDEM_I8_FIN(R, A, L, H)                                                                              \
    if constexpr (MR > R) {                                                                                    \
      const __m256 s = _mm256_set1_ps(dx[R * nb + b]);                                                         \
      A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(L, ones)), _mm256_mul_ps(dl, s), A);            \
      A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(H, ones)), _mm256_mul_ps(dh, s), A);            \
    }
    TANDEM_I8_FIN(0, a0, l0, h0) TANDEM_I8_FIN(1, a1, l1, h1) TANDEM_I8_FIN(2, a2, l2, h2) TANDEM_I8_FIN(3, a3, l3, h3)
#undef TANDEM_I8_FIN
  }
  store_tile<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

template <int MR, typename Y>
inline void tile(int qtype, Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* sx,
                 const uint8_t* rec, const float* bias, int64_t cols) {
  if (qtype == kQ4_1) tile_q4_1<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
  else if (qtype == kQ8_0) tile_q8_0<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
  else if (qtype == kQ6_K) tile_q6_k<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
  else tile_q4_k<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
}
#endif

}  // namespace

bool i8_linear_available() {
#ifdef TANDEM_QUANT_I8
  return true;
#else
  return false;
#endif
}

#ifdef TANDEM_QUANT_I8
namespace {

// One Q6_K super-block (ggml's block_q6_K: ql[128], qh[64], int8 scales[16], float16 d) -> its 256
// q (0..63) in input order and its 16 scales times d.
void decode_q6_k(const uint8_t* blk, uint8_t* q, float* dsc) {
  const float d = static_cast<float>(c10::Half(*reinterpret_cast<const uint16_t*>(blk + 208), c10::Half::from_bits()));
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = blk + 64 * n;
    const uint8_t* qh = blk + 128 + 32 * n;
    for (int l = 0; l < 32; ++l) {
      q[128 * n + l] = static_cast<uint8_t>((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
      q[128 * n + l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
      q[128 * n + l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      q[128 * n + l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
  for (int i = 0; i < 16; ++i) dsc[i] = d * static_cast<float>(static_cast<int8_t>(blk[192 + i]));
}

// Row j's part of a Q6_K record for inputs q[0..31] (see the layout above).
void pack_q6_k_row(uint8_t* rec, int64_t j, const uint8_t* q, float dlo, float dhi) {
  for (int v = 0; v < 4; ++v)
    for (int t = 0; t < 4; ++t) {
      rec[32 * v + 4 * j + t] = static_cast<uint8_t>((q[4 * v + t] & 0x0F) | ((q[16 + 4 * v + t] & 0x0F) << 4));
      const int shift = 4 * (v & 1);
      rec[128 + 32 * (v >> 1) + 4 * j + t] |=
          static_cast<uint8_t>((((q[4 * v + t] >> 4) & 3) | (((q[16 + 4 * v + t] >> 4) & 3) << 2)) << shift);
    }
  const uint16_t lo = c10::Half(dlo).x, hi = c10::Half(dhi).x;
  std::memcpy(rec + 192 + 2 * j, &lo, 2);
  std::memcpy(rec + 208 + 2 * j, &hi, 2);
}

// Row j's part of a Q4_K record from its super-block (ggml's block_q4_K: float16 d and dmin, 12
// bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of q, sub-blocks 2c and 2c + 1
// in the low and high nibbles of bytes 32c..32c+31; w = d sc q - dmin m).
void pack_q4_k_row(uint8_t* rec, int64_t j, const uint8_t* blk) {
  std::memcpy(rec + 1024 + 2 * j, blk, 2);
  const uint16_t neg_dmin = static_cast<uint16_t>(*reinterpret_cast<const uint16_t*>(blk + 2) ^ 0x8000);
  std::memcpy(rec + 1040 + 2 * j, &neg_dmin, 2);      // -dmin: the records add m
  const uint8_t* sc = blk + 4;
  for (int t = 0; t < 8; ++t) {
    // ggml's get_scale_min_k4
    const uint8_t scale = t < 4 ? sc[t] & 63 : (sc[t + 4] & 0x0F) | ((sc[t - 4] >> 6) << 4);
    const uint8_t mn = t < 4 ? sc[t + 4] & 63 : (sc[t + 4] >> 4) | ((sc[t] >> 6) << 4);
    rec[1056 + 8 * t + j] = scale;
    rec[1120 + 8 * t + j] = mn;
    uint8_t q[kBlock];
    const uint8_t* qs = blk + 16 + 32 * (t / 2);
    for (int i = 0; i < kBlock; ++i) q[i] = t % 2 == 0 ? qs[i] & 0x0F : qs[i] >> 4;
    for (int v = 0; v < 4; ++v)
      for (int u = 0; u < 4; ++u)
        rec[128 * t + 32 * v + 4 * j + u] = static_cast<uint8_t>(q[4 * v + u] | (q[16 + 4 * v + u] << 4));
  }
}

}  // namespace
#endif

// GGML Q4_1 (qtype 0), Q8_0 (qtype 1), Q6_K (qtype 2) or Q4_K (qtype 3) blocks uint8 [N, K/32 * 20 |
// K/32 * 34 | K/256 * 210 | K/256 * 144] -> uint8 [ceil(N/8), K/32 * 160 | 272 | 224 | K/256 * 1184]
// records (rows past N zero).
torch::Tensor quant_pack_i8(torch::Tensor data, int64_t n, int64_t k, int64_t qtype) {
  TORCH_CHECK(valid_qtype(qtype), "quant_pack_i8: qtype must be 0 (Q4_1), 1 (Q8_0), 2 (Q6_K) or 3 (Q4_K), got ", qtype);
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.scalar_type() == at::kByte && data.dim() == 2,
              "quant_pack_i8: data must be contiguous uint8 [N, row bytes] on CPU");
  const int64_t src_row = source_row_bytes(qtype, k), record = record_bytes(static_cast<int>(qtype));
  TORCH_CHECK(k % (k_quant(qtype) ? kSuper : kBlock) == 0 && data.size(0) == n && data.size(1) == src_row,
              "quant_pack_i8: data does not hold [N, K] ", qtype_name(qtype), " blocks");
#ifndef TANDEM_QUANT_I8
  TORCH_CHECK(false, "quant_pack_i8: this build has no AVX2 + FMA + F16C");
#else
  const int64_t nb = k / kBlock, groups = (n + kGroup - 1) / kGroup, src_block = source_block_bytes(static_cast<int>(qtype));
  auto out = torch::zeros({groups, group_bytes(static_cast<int>(qtype), k)}, torch::dtype(torch::kUInt8));
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (qtype == kQ6_K) {
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      uint8_t q[kSuper];
      float dsc[16];
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j)
          for (int64_t sb = 0; sb < k / kSuper; ++sb) {
            decode_q6_k(src + (g * kGroup + j) * src_row + sb * kQ6_KBytes, q, dsc);
            for (int64_t t = 0; t < kSuper / kBlock; ++t)
              pack_q6_k_row(dst + (g * nb + sb * (kSuper / kBlock) + t) * record, j, q + kBlock * t, dsc[2 * t],
                            dsc[2 * t + 1]);
          }
    });
    return out;
  }
  if (qtype == kQ4_K) {
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j)
          for (int64_t sb = 0; sb < k / kSuper; ++sb)
            pack_q4_k_row(dst + (g * (k / kSuper) + sb) * record, j, src + (g * kGroup + j) * src_row + sb * kQ4_KBytes);
    });
    return out;
  }
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (g * nb + b) * record;
        uint16_t dm[2][kGroup] = {};      // the blocks' float16 d (and m), 8 rows side by side
        for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j) {
          const uint8_t* blk = src + (g * kGroup + j) * nb * src_block + b * src_block;
          std::memcpy(&dm[0][j], blk, 2);
          if (qtype == kQ4_1) {
            std::memcpy(&dm[1][j], blk + 2, 2);
            // GGML order: byte i holds weight i (low nibble) and weight i + 16 (high nibble)
            uint8_t q[kBlock];
            for (int i = 0; i < 16; ++i) { q[i] = blk[4 + i] & 0x0F; q[i + 16] = blk[4 + i] >> 4; }
            for (int v = 0; v < 4; ++v)
              for (int t = 0; t < 4; ++t)
                rec[32 * v + 4 * j + t] = static_cast<uint8_t>(q[4 * v + t] | (q[16 + 4 * v + t] << 4));
          } else {
            for (int v = 0; v < 8; ++v) std::memcpy(rec + 32 * v + 4 * j, blk + 2 + 4 * v, 4);
          }
        }
        if (qtype == kQ4_1) std::memcpy(rec + 128, dm, sizeof(dm));
        else std::memcpy(rec + 256, dm[0], sizeof(dm[0]));
      }
  });
  return out;
#endif
}

// A layer's output rows as segments of one record type each (one segment, or a fused layer whose
// parts' GGUF types differ, as a Q4_K_M file's q/k/v do where v is Q6_K): the segments' records lie
// back to back in `w`.
namespace {

struct Segment {
  int q;                 // record type
  int64_t rows;          // output rows
  int64_t first_group;   // index of its first group of 8 rows among all segments' groups
  int64_t col;           // its first output column
  int64_t offset;        // byte offset of its records in w
};

std::vector<Segment> segments(const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t k) {
  std::vector<Segment> out;
  int64_t group = 0, col = 0, offset = 0;
  for (size_t i = 0; i < qtypes.size(); ++i) {
    const int q = static_cast<int>(qtypes[i]);
    out.push_back(Segment{q, rows[i], group, col, offset});
    const int64_t groups = (rows[i] + kGroup - 1) / kGroup;
    group += groups;
    col += rows[i];
    offset += groups * group_bytes(q, k);
  }
  return out;
}

}  // namespace

#ifdef TANDEM_QUANT_I8
template <typename T>
void linear_i8(const T* xp, T* yp, int64_t m, int64_t k, int64_t n, const std::vector<Segment>& segs,
               const uint8_t* wp, const float* bp) {
  const int64_t nb = k / kBlock;
  int64_t groups = 0;
  for (const Segment& s : segs) groups += (s.rows + kGroup - 1) / kGroup;
  std::vector<int8_t> qx(m * k);
  std::vector<float> dx(m * nb), sx(m * nb);
  if (m == 1) {
    quantize_row(xp, k, qx.data(), dx.data(), sx.data());    // no thread hand-off for one row
  } else {
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * k, k, qx.data() + r * k, dx.data() + r * nb, sx.data() + r * nb);
    });
  }
  for (int64_t c0 = 0; c0 < m; c0 += kChunkRows) {
    const int64_t c1 = std::min(m, c0 + kChunkRows);
    at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
      size_t si = 0;
      for (int64_t g = g0; g < g1; ++g) {
        while (si + 1 < segs.size() && g >= segs[si + 1].first_group) ++si;
        const Segment& s = segs[si];
        const int q = s.q;
        const uint8_t* rec = wp + s.offset + (g - s.first_group) * group_bytes(q, k);
        const int64_t col = s.col + (g - s.first_group) * kGroup, cols = std::min(kGroup, s.col + s.rows - col);
        const float* bg = bp != nullptr ? bp + col : nullptr;
        int64_t r = c0;
        for (; r + 4 <= c1; r += 4)
          tile<4>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
        const int64_t left = c1 - r;
        if (left == 0) continue;
        if (left == 3) tile<3>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
        else if (left == 2) tile<2>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
        else tile<1>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
      }
    });
  }
}
#endif

namespace {

torch::Tensor run_linear_i8(torch::Tensor x, const uint8_t* wp, c10::optional<torch::Tensor> bias, int64_t n,
                            const std::vector<Segment>& segs) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  x = x.contiguous();
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  torch::Tensor b32;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && (bias->scalar_type() == at::kFloat || bias->scalar_type() == x.scalar_type()),
                "quant_linear_i8: bias must be [N], float32 or x's dtype");
    b32 = bias->to(at::kFloat).contiguous();
    bp = b32.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
#ifndef TANDEM_QUANT_I8
  TORCH_CHECK(false, "quant_linear_i8: this build has no AVX2 + FMA + F16C");
#else
  if (bf16) linear_i8(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), m, k, n, segs, wp, bp);
  else linear_i8(x.data_ptr<float>(), y.data_ptr<float>(), m, k, n, segs, wp, bp);
#endif
  return y;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_i8: x must be float32 or bfloat16 on CPU");
}

}  // namespace

// x: float32 or bfloat16 [..., K]; w: quant_pack_i8's records of `qtype`; bias: [N] (float32, or
// x's dtype) or none. Returns [..., N] in x's dtype (bfloat16 rounded once, from the float32 sums).
torch::Tensor quant_linear_i8(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n,
                              int64_t qtype) {
  TORCH_CHECK(valid_qtype(qtype), "quant_linear_i8: qtype must be 0 (Q4_1), 1 (Q8_0), 2 (Q6_K) or 3 (Q4_K), got ", qtype);
  check_x(x);
  const int q = static_cast<int>(qtype);
  const int64_t k = x.size(-1), groups = (n + kGroup - 1) / kGroup;
  TORCH_CHECK(k % (k_quant(q) ? kSuper : kBlock) == 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 2 && w.size(0) == groups && w.size(1) == group_bytes(q, k),
              "quant_linear_i8: w does not hold quant_pack_i8 records for [N, K]");
  return run_linear_i8(x, w.data_ptr<uint8_t>(), bias, n, segments({qtype}, {n}, k));
}

// A fused layer whose parts have different record types: w is the parts' quant_pack_i8 records,
// each flattened, back to back (uint8 [total bytes]); part i has rows[i] output rows of type
// qtypes[i]. The same arithmetic as quant_linear_i8 on each part, one output.
torch::Tensor quant_linear_i8_parts(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                    std::vector<int64_t> qtypes, std::vector<int64_t> rows) {
  check_x(x);
  TORCH_CHECK(!qtypes.empty() && qtypes.size() == rows.size(), "quant_linear_i8_parts: one type per part");
  const int64_t k = x.size(-1);
  int64_t n = 0, bytes = 0;
  for (size_t i = 0; i < qtypes.size(); ++i) {
    TORCH_CHECK(valid_qtype(qtypes[i]) && rows[i] > 0, "quant_linear_i8_parts: part ", i, " has type ", qtypes[i],
                " and ", rows[i], " rows");
    TORCH_CHECK(k % (k_quant(qtypes[i]) ? kSuper : kBlock) == 0, "quant_linear_i8_parts: K = ", k, " does not fit ",
                qtype_name(qtypes[i]), " blocks");
    n += rows[i];
    bytes += (rows[i] + kGroup - 1) / kGroup * group_bytes(static_cast<int>(qtypes[i]), k);
  }
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == bytes,
              "quant_linear_i8_parts: w does not hold the parts' quant_pack_i8 records for K = ", k);
  return run_linear_i8(x, w.data_ptr<uint8_t>(), bias, n, segments(qtypes, rows, k));
}

void register_quant_i8(pybind11::module_& m) {
  m.def("i8_linear_available", &i8_linear_available, "whether quant_linear_i8 runs here (AVX2 + FMA + F16C)");
  m.def("quant_pack_i8", &quant_pack_i8, "GGML Q4_1, Q8_0, Q6_K or Q4_K blocks -> 8-row records for quant_linear_i8");
  m.def("quant_linear_i8", &quant_linear_i8, "x @ W^T (+ bias), W in Q4_1, Q8_0, Q6_K or Q4_K records, x rounded to 8 bits per block (Q8_1 / Q8_0)");
  m.def("quant_linear_i8_parts", &quant_linear_i8_parts, "quant_linear_i8 over a fused layer whose parts' record types differ");
}
