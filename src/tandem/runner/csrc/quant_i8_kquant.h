// K-quants in the 8-bit-activation kernel, from the file's own bits (see quant_i8.cpp for the
// arithmetic they share with Q4_1 and Q8_0).
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
// Layout (quant_pack_i8), groups of 8 output rows as for Q4_1 and Q8_0. Q6_K, 224 bytes per block
// of 32: Q4_1's 4 vectors of low 4 bits; 2 vectors of high 2 bits, vector u holding in byte 4j+t the
// bits of inputs 8u+t, 16+8u+t, 8u+4+t and 16+8u+4+t (bits 0-1, 2-3, 4-5, 6-7); the 8 rows' d sc of
// inputs 0..15, then of 16..31, as float16. Q4_K, 1,184 bytes per super-block of 256: the 8 blocks'
// q as Q4_1 records hold them (8 x 128 bytes), the 8 rows' d and -dmin as float16, then per block
// the 8 rows' 6-bit scales, then mins, a byte each.
#pragma once

#include "quant_i8.h"

namespace {

#ifdef TANDEM_QUANT_I8
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
  store_tile_q4<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
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

#endif

}  // namespace
