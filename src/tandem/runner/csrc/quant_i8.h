// The 8-bit-activation kernel's shared parts (quant_i8.cpp, quant_i8_kquant.h): record types
// and sizes, rounding x to 8 bits per block of 32, and the dot products of a block of 4-bit q.
// In an anonymous namespace: each file that includes it gets its own copy.
#pragma once

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

// The tile's outputs after its blocks went through block_q4: with 1 or 2 rows the m terms sit in
// a2 / a3 and are added back first.
template <int MR, typename Y>
inline void store_tile_q4(Y* y, int64_t ldy, __m256 a0, __m256 a1, __m256 a2, __m256 a3, const float* bias,
                          int64_t cols) {
  if constexpr (MR <= 2) {
    a0 = _mm256_add_ps(a0, a2);
    a1 = _mm256_add_ps(a1, a3);
  }
  store_tile<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

#endif

}  // namespace
