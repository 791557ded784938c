// AVX512-BF16 decode attention: bfloat16 queries over a bfloat16 cache (paged_attention.cpp picks it).
#pragma once

#include "paged_attention.h"

namespace {

#ifdef TANDEM_DECODE_BF16
// ---- AVX512-BF16 decode attention: bfloat16 queries over a bfloat16 cache ----------------------
// One (query, kv head) item as attend_item, on VDPBF16PS (32 multiply-adds per instruction, no
// widening of K/V): scores 16 keys at a time (a key row's dot products with the G query heads, then
// one 16-way reduction per head), softmax in float32, the probabilities rounded to bfloat16 (as the
// prefill kernel and bfloat16 SDPA do) for the weighted sum of V over key pairs. Where K/V stream
// from memory (every layer of a large batch) the bound is the scattered blocks, not the arithmetic;
// docs/engine.md has its measured speed against attend_item.

// The sums of 16 vectors: [sum(v0), ..., sum(v15)].
inline __m512 reduce16(const __m512* v) {
  __m512 l1[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 l2[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(l1[2 * i]), b = _mm512_castps_pd(l1[2 * i + 1]);
    l2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(l2[0], l2[1], 0x88), _mm512_shuffle_f32x4(l2[0], l2[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2], l2[3], 0x88), _mm512_shuffle_f32x4(l2[2], l2[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// acc[g][c] += pair products of V rows (t, t+1) interleaved and the heads' probability pairs.
template <int NG>
inline void pv_pairs(__m512* acc, const __m512i* vp, const uint16_t* const* pb, int64_t t) {
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g) {
    int32_t pair;
    std::memcpy(&pair, pb[g] + t, sizeof pair);
    const __m512bh p = as_bh(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[g * 4 + c] = _mm512_dpbf16_ps(acc[g * 4 + c], as_bh(vp[c]), p);
  }
}

// NG heads (of the group) over one 64-dimension chunk dc of V: out[g][dc .. dc + 63].
template <int NG>
void pv_chunk(float* out, const uint16_t* const* pb, const uint16_t* vh, const int32_t* blocks, int64_t ctx,
              int64_t bs, int64_t d, int64_t dc) {
  __m512 acc[NG * 4];
#pragma GCC unroll 16
  for (int i = 0; i < NG * 4; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
    const uint16_t* vb = vh + static_cast<int64_t>(blocks[b]) * bs * d + dc;
    const int64_t len = std::min(bs, ctx - t0);
    if (dc == 0) prefetch_ahead(vh, blocks, b, ctx, bs, d);
    for (int64_t o = 0; o < len; o += 2) {
      const uint16_t* r0 = vb + o * d;
      const __m512i a0 = _mm512_loadu_si512(r0), a1 = _mm512_loadu_si512(r0 + 32);
      __m512i b0 = zero, b1 = zero;
      if (o + 1 < len) { b0 = _mm512_loadu_si512(r0 + d); b1 = _mm512_loadu_si512(r0 + d + 32); }
      const __m512i vp[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                             _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
      pv_pairs<NG>(acc, vp, pb, t0 + o);
    }
  }
  // lane i of acc c: dimension 32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4
  alignas(64) float tmp[16];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) {
      _mm512_store_ps(tmp, acc[g * 4 + c]);
      for (int i = 0; i < 16; ++i) out[g * d + dc + 32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4] = tmp[i];
    }
}

// One (query, kv head) item: q [G, d] bfloat16 (the group's heads), K/V bfloat16 paged, bs % 16 == 0,
// d % 64 == 0. Scores on VDPBF16PS, 16 keys per vector (one reduction of 16 dot products); softmax in
// float32; probabilities rounded to bfloat16 and the weighted sum of V on VDPBF16PS over key pairs.
void attend_item_bf16(float* out, const uint16_t* q, int64_t g_size, const uint16_t* kh, const uint16_t* vh,
                      const int32_t* blocks, int64_t ctx, int64_t bs, int64_t d, float scale, float* scores,
                      uint16_t* pbf) {
  const int64_t dq = d / 32;
  __m512i qv[8][4];                                   // g_size <= 8, d <= 128
  for (int64_t g = 0; g < g_size; ++g)
    for (int64_t j = 0; j < dq; ++j) qv[g][j] = _mm512_loadu_si512(q + g * d + 32 * j);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
    const uint16_t* kb = kh + static_cast<int64_t>(blocks[b]) * bs * d;
    const int64_t len = std::min(bs, ctx - t0);
    prefetch_ahead(kh, blocks, b, ctx, bs, d);
    for (int64_t o0 = 0; o0 < len; o0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - o0);
      for (int64_t g = 0; g < g_size; ++g) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          acc[r] = _mm512_setzero_ps();
          if (r < n) {
            const uint16_t* kr = kb + (o0 + r) * d;
            for (int64_t j = 0; j < dq; ++j)
              acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(qv[g][j]), as_bh(_mm512_loadu_si512(kr + 32 * j)));
          }
        }
        _mm512_mask_storeu_ps(scores + g * ctx + t0 + o0, static_cast<__mmask16>((1u << n) - 1),
                              _mm512_mul_ps(reduce16(acc), sv));
      }
    }
  }
  for (int64_t g = 0; g < g_size; ++g) {
    float* sg = scores + g * ctx;
    uint16_t* pg = pbf + g * (ctx + 2);
    const float inv = 1.f / exp_sub_sum(sg, ctx, max_of(sg, ctx));
    const __m512 iv = _mm512_set1_ps(inv);
    int64_t t = 0;
    for (; t + 16 <= ctx; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + t), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sg + t), iv)));
    for (; t < ctx; ++t) pg[t] = c10::BFloat16(sg[t] * inv).x;
    pg[ctx] = 0;
  }
  for (int64_t dc = 0; dc < d; dc += 64) {
    for (int64_t g0 = 0; g0 < g_size; g0 += 4) {
      const int ng = static_cast<int>(std::min<int64_t>(4, g_size - g0));
      const uint16_t* pb[4];
      for (int g = 0; g < ng; ++g) pb[g] = pbf + (g0 + g) * (ctx + 2);
      float* o = out + g0 * d;
      switch (ng) {
        case 1: pv_chunk<1>(o, pb, vh, blocks, ctx, bs, d, dc); break;
        case 2: pv_chunk<2>(o, pb, vh, blocks, ctx, bs, d, dc); break;
        case 3: pv_chunk<3>(o, pb, vh, blocks, ctx, bs, d, dc); break;
        default: pv_chunk<4>(o, pb, vh, blocks, ctx, bs, d, dc); break;
      }
    }
  }
}

#endif  // TANDEM_DECODE_BF16

}  // namespace
