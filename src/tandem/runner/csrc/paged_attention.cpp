// Paged attention that reads K/V blocks in place instead of gathering them into a padded copy:
// float32, bfloat16 or float16 caches read as float32 (attend_item), and on CPUs with AVX512-BF16
// bfloat16 queries over a bfloat16 cache on VDPBF16PS (attend_item_bf16).
// Every kernel computes in float32 whatever the storage dtype (float32, bfloat16, float16).
#include "common.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(TANDEM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TANDEM_DECODE_BF16 1
#endif

namespace {

// In place: x[i] = exp(x[i] - m); returns the sum.
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef TANDEM_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) { x[i] = std::exp(x[i] - m); sum += x[i]; }
  return sum;
}

// Paged attention for queries that each see a prefix of their sequence's context.
// q: [N, H, D]; k/v cache: [KV, S, D] with slot = block * bs + offset; table: [B, MB] block ids;
// seq: [N] row of `table` for each query; pos: [N] the query's position (it sees 0..pos).
// Two passes per (query, kv head): scores for the G query heads sharing the kv head, then a
// softmax-weighted sum of V rows; every K and V row is read once per (query, kv head).
// score[g][t] = scale * <q_g, k_t> for the G query heads sharing one kv head (G <= 8).
template <typename T>
inline void scores_row(float* out, int64_t stride, const float* qf, int64_t g_size, const T* kr, int64_t d, float scale) {
#ifdef TANDEM_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (d % 8 == 0) {
      for (int64_t g0 = 0; g0 < g_size; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, g_size - g0);
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < d; j += 8) {
          const __m256 kv = _mm256_loadu_ps(kr + j);
          for (int64_t g = 0; g < gn; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (g0 + g) * d + j), kv, acc[g]);
        }
        for (int64_t g = 0; g < gn; ++g) out[(g0 + g) * stride] = hsum8(acc[g]) * scale;
      }
      return;
    }
  }
#endif
  for (int64_t g = 0; g < g_size; ++g) {
    const float* qg = qf + g * d;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < d; ++j) s += qg[j] * f32(kr[j]);
    out[g * stride] = s * scale;
  }
}

// acc[g] += p[g] * v for the G heads.
template <typename T>
inline void accumulate_row(float* acc, const float* p, int64_t stride, int64_t g_size, const T* vr, int64_t d) {
#ifdef TANDEM_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (d % 8 == 0) {
      for (int64_t j = 0; j < d; j += 8) {
        const __m256 vv = _mm256_loadu_ps(vr + j);
        for (int64_t g = 0; g < g_size; ++g) {
          float* a = acc + g * d + j;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[g * stride]), vv, _mm256_loadu_ps(a)));
        }
      }
      return;
    }
  }
#endif
  for (int64_t g = 0; g < g_size; ++g) {
    const float pg = p[g * stride];
    float* a = acc + g * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) a[j] += pg * f32(vr[j]);
  }
}

// Paged attention for queries that each see a prefix of their sequence's context.
// q: [N, H, D]; k/v cache: [KV, S, D] with slot = block * bs + offset; table: [B, MB] block ids;
// seq: [N] row of `table` for each query; pos: [N] the query's position (it sees 0..pos).
// Two passes per (query, kv head): scores for the G query heads sharing the kv head, softmax, then
// a weighted sum of V rows; every K and V row is read once per (query, kv head), in place.
#ifdef TANDEM_AVX2
// The sums of eight vectors: [sum(a0), ..., sum(a7)] (a transpose by horizontal adds).
inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// K/V are read with ld8 (common.h): float32, bfloat16 or float16 widened to float32.
template <typename T>
constexpr bool kVectorKV = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>
#ifdef __F16C__
                           || std::is_same_v<T, c10::Half>
#endif
    ;

inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float m = _mm_cvtss_f32(m4);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Blocks are prefetched this many ahead: one block's arithmetic (~100 ns) is shorter than a
// trip to memory, so one block ahead arrives too late.
constexpr int64_t kPrefetchBlocks = 4;

template <typename T>
inline void prefetch_ahead(const T* base, const int32_t* blocks, int64_t b, int64_t ctx, int64_t bs, int64_t d) {
  const int64_t nb = (ctx + bs - 1) / bs;
  for (int64_t a = (b == 0 ? 1 : b + kPrefetchBlocks); a <= std::min(nb - 1, b + kPrefetchBlocks); ++a)
    prefetch_block(base + static_cast<int64_t>(blocks[a]) * bs * d,
                   std::min(bs, ctx - a * bs) * d * static_cast<int64_t>(sizeof(T)));
}

// One (query, kv head) item of paged attention for float32, bfloat16 or float16 K/V (read as
// float32) and head_dim % 64 == 0, with the accumulators in named registers (GCC spills arrays
// of __m256 to memory on every iteration).
// Scores: eight context rows at a time, one vector of eight dot products per pass (no horizontal
// sum per row). Weighted V sum: per 64 dims, eight accumulators, one broadcast per row. The next
// block is prefetched while this one is read: paged blocks are scattered, one 4 KB page each at
// 16 x 64 floats, so the hardware prefetcher cannot follow them.
template <typename T>
void attend_item(float* out, const float* qf, int64_t g_size, const T* kh, const T* vh,
                     const int32_t* blocks, int64_t ctx, int64_t bs, int64_t d, float scale, float* scores,
                     float* acc) {
  const int64_t bf = bs * d;    // floats per block of one head
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
    const T* kb = kh + static_cast<int64_t>(blocks[b]) * bf;
    const int64_t len = std::min(bs, ctx - t0);
    prefetch_ahead(kh, blocks, b, ctx, bs, d);
    for (int64_t g = 0; g < g_size; ++g) {
      const float* qg = qf + g * d;
      float* sg = scores + g * ctx + t0;
      int64_t o = 0;
      for (; o + 8 <= len; o += 8) {
        const T* k0 = kb + o * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t j = 0; j < d; j += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + j);
          a0 = _mm256_fmadd_ps(qv, ld8(k0 + j), a0);
          a1 = _mm256_fmadd_ps(qv, ld8(k0 + d + j), a1);
          a2 = _mm256_fmadd_ps(qv, ld8(k0 + 2 * d + j), a2);
          a3 = _mm256_fmadd_ps(qv, ld8(k0 + 3 * d + j), a3);
          a4 = _mm256_fmadd_ps(qv, ld8(k0 + 4 * d + j), a4);
          a5 = _mm256_fmadd_ps(qv, ld8(k0 + 5 * d + j), a5);
          a6 = _mm256_fmadd_ps(qv, ld8(k0 + 6 * d + j), a6);
          a7 = _mm256_fmadd_ps(qv, ld8(k0 + 7 * d + j), a7);
        }
        _mm256_storeu_ps(sg + o, _mm256_mul_ps(hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7), sv));
      }
      for (; o < len; ++o) {
        const T* kr = kb + o * d;
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), ld8(kr + j), a);
        sg[o] = hsum8(a) * scale;
      }
    }
  }
  for (int64_t g = 0; g < g_size; ++g) {
    float* sg = scores + g * ctx;
    const float inv = 1.f / exp_sub_sum(sg, ctx, max_of(sg, ctx));
    const __m256 iv = _mm256_set1_ps(inv);
    int64_t t = 0;
    for (; t + 8 <= ctx; t += 8) _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), iv));
    for (; t < ctx; ++t) sg[t] *= inv;
  }
  std::fill(acc, acc + g_size * d, 0.f);
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
    const T* vb = vh + static_cast<int64_t>(blocks[b]) * bf;
    const int64_t len = std::min(bs, ctx - t0);
    prefetch_ahead(vh, blocks, b, ctx, bs, d);
    for (int64_t g = 0; g < g_size; ++g) {
      const float* pg = scores + g * ctx + t0;
      for (int64_t dc = 0; dc < d; dc += 64) {
        float* ag = acc + g * d + dc;
        __m256 c0 = _mm256_loadu_ps(ag), c1 = _mm256_loadu_ps(ag + 8), c2 = _mm256_loadu_ps(ag + 16), c3 = _mm256_loadu_ps(ag + 24);
        __m256 c4 = _mm256_loadu_ps(ag + 32), c5 = _mm256_loadu_ps(ag + 40), c6 = _mm256_loadu_ps(ag + 48), c7 = _mm256_loadu_ps(ag + 56);
        for (int64_t o = 0; o < len; ++o) {
          const __m256 p = _mm256_broadcast_ss(pg + o);
          const T* vr = vb + o * d + dc;
          c0 = _mm256_fmadd_ps(p, ld8(vr), c0);
          c1 = _mm256_fmadd_ps(p, ld8(vr + 8), c1);
          c2 = _mm256_fmadd_ps(p, ld8(vr + 16), c2);
          c3 = _mm256_fmadd_ps(p, ld8(vr + 24), c3);
          c4 = _mm256_fmadd_ps(p, ld8(vr + 32), c4);
          c5 = _mm256_fmadd_ps(p, ld8(vr + 40), c5);
          c6 = _mm256_fmadd_ps(p, ld8(vr + 48), c6);
          c7 = _mm256_fmadd_ps(p, ld8(vr + 56), c7);
        }
        _mm256_storeu_ps(ag, c0); _mm256_storeu_ps(ag + 8, c1); _mm256_storeu_ps(ag + 16, c2); _mm256_storeu_ps(ag + 24, c3);
        _mm256_storeu_ps(ag + 32, c4); _mm256_storeu_ps(ag + 40, c5); _mm256_storeu_ps(ag + 48, c6); _mm256_storeu_ps(ag + 56, c7);
      }
    }
  }
  std::memcpy(out, acc, g_size * d * sizeof(float));
}

#ifdef TANDEM_DECODE_BF16
// ---- AVX512-BF16 decode attention: bfloat16 queries over a bfloat16 cache ----------------------
// One (query, kv head) item as attend_item, on VDPBF16PS (32 multiply-adds per instruction, no
// widening of K/V): scores 16 keys at a time (a key row's dot products with the G query heads, then
// one 16-way reduction per head), softmax in float32, the probabilities rounded to bfloat16 (as the
// prefill kernel and bfloat16 SDPA do) for the weighted sum of V over key pairs. On a 2-core Zen 5:
// 1.9-2.1x attend_item where the K/V fit in L3, 1.4x where they stream from memory (every layer
// of a large batch), the bound there being the scattered 2 KB blocks (a microbenchmark).

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
#endif

// TQ: the queries' and output's dtype; TKV: the cache's (float32 queries over a float16 or bfloat16
// cache read it widened to float32, half the bytes of a float32 cache).
template <typename TQ, typename TKV>
void paged_attention_impl(TQ* out, const TQ* q, int64_t q_row, const TKV* kc, const TKV* vc, const int32_t* table,
                          const int32_t* seq, const int32_t* pos, int64_t n, int64_t heads, int64_t kv_heads,
                          int64_t d, int64_t slots, int64_t max_blocks, int64_t bs, float scale) {
  const int64_t g_size = heads / kv_heads;
  // Items (query, kv head) are dealt round robin over the threads: a prefill chunk's queries see
  // ever longer contexts, and contiguous halves would give one thread three times the work.
  const int64_t items = n * kv_heads, threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const int64_t chunk = (items + threads - 1) / threads;
#ifdef TANDEM_DECODE_BF16
  const bool bf16_kernel = std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<TKV, c10::BFloat16> &&
                           d % 64 == 0 && d <= 128 && g_size <= 8 && bs % 16 == 0;
#endif
  at::parallel_for(0, chunk * threads, chunk, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, res, qf(g_size * d), acc(g_size * d);
    std::vector<uint16_t> probs;    // the bfloat16 kernel's rounded probabilities
    for (int64_t j = begin; j < end; ++j) {
      const int64_t item = (j % chunk) * threads + j / chunk;
      if (item >= items) continue;
      const int64_t i = item / kv_heads, h = item % kv_heads;
      const int64_t ctx = static_cast<int64_t>(pos[i]) + 1;
      const int32_t* blocks = table + static_cast<int64_t>(seq[i]) * max_blocks;
      scores.resize(g_size * ctx);
      const TKV* kh = kc + h * slots * d;
      const TKV* vh = vc + h * slots * d;
      TQ* dst = out + (i * heads + h * g_size) * d;   // the group's G output rows
#ifdef TANDEM_DECODE_BF16
      if (bf16_kernel) {
        probs.resize(g_size * (ctx + 2));
        res.resize(g_size * d);
        attend_item_bf16(res.data(), reinterpret_cast<const uint16_t*>(q + i * q_row + h * g_size * d), g_size,
                         reinterpret_cast<const uint16_t*>(kh), reinterpret_cast<const uint16_t*>(vh), blocks, ctx,
                         bs, d, scale, scores.data(), probs.data());
        for (int64_t x = 0; x < g_size * d; ++x) dst[x] = static_cast<TQ>(res[x]);
        continue;
      }
#endif
      for (int64_t g = 0; g < g_size; ++g)
        for (int64_t j = 0; j < d; ++j) qf[g * d + j] = f32(q[i * q_row + (h * g_size + g) * d + j]);
#ifdef TANDEM_AVX2
      if constexpr (kVectorKV<TKV>) {
        if (d % 64 == 0) {
          if constexpr (std::is_same_v<TQ, float>) {
            attend_item(dst, qf.data(), g_size, kh, vh, blocks, ctx, bs, d, scale, scores.data(), acc.data());
          } else {
            res.resize(g_size * d);
            attend_item(res.data(), qf.data(), g_size, kh, vh, blocks, ctx, bs, d, scale, scores.data(), acc.data());
            for (int64_t x = 0; x < g_size * d; ++x) dst[x] = static_cast<TQ>(res[x]);
          }
          continue;
        }
      }
#endif
      // Walk the context block by block (no division per token).
      for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
        const TKV* kb = kh + static_cast<int64_t>(blocks[b]) * bs * d;
        const int64_t len = std::min(bs, ctx - t0);
        for (int64_t o = 0; o < len; ++o) scores_row(scores.data() + t0 + o, ctx, qf.data(), g_size, kb + o * d, d, scale);
      }
      for (int64_t g = 0; g < g_size; ++g) {
        float* sg = scores.data() + g * ctx;
        const float m = *std::max_element(sg, sg + ctx);
        const float inv = 1.f / exp_sub_sum(sg, ctx, m);
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
        const TKV* vb = vh + static_cast<int64_t>(blocks[b]) * bs * d;
        const int64_t len = std::min(bs, ctx - t0);
        for (int64_t o = 0; o < len; ++o) accumulate_row(acc.data(), scores.data() + t0 + o, ctx, g_size, vb + o * d, d);
      }
      for (int64_t g = 0; g < g_size; ++g)
        for (int64_t j = 0; j < d; ++j) dst[g * d + j] = static_cast<TQ>(acc[g * d + j]);
    }
  });
}

}  // namespace

// q: [N, H, D], its rows may be strided (a slice of the fused qkv output) but each row's heads are packed.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                              torch::Tensor seq, torch::Tensor pos, int64_t block_size, double scale) {
  for (auto* t : {&k_cache, &v_cache, &table, &seq, &pos}) check(*t, "argument");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "paged_attention: q must be [N, heads, head_dim] on the CPU");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  const int64_t q_row = q.stride(0);
  TORCH_CHECK(table.scalar_type() == at::kInt && seq.scalar_type() == at::kInt && pos.scalar_type() == at::kInt,
              "table, seq and pos must be int32");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(0);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: k and v caches differ in dtype");
  auto out = torch::empty({n, heads * d}, q.options());
  if (k_cache.scalar_type() == q.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
      paged_attention_impl<scalar_t, scalar_t>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q_row, k_cache.data_ptr<scalar_t>(),
                                               v_cache.data_ptr<scalar_t>(), table.data_ptr<int32_t>(), seq.data_ptr<int32_t>(),
                                               pos.data_ptr<int32_t>(), n, heads, kv_heads, d, k_cache.size(1), table.size(1),
                                               block_size, static_cast<float>(scale));
    });
    return out;
  }
  // float32 queries over a 16-bit cache (kv_cache_dtype float16 or bfloat16 under a float32 model)
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: a cache dtype other than the queries' needs float32 queries");
  AT_DISPATCH_REDUCED_FLOATING_TYPES(k_cache.scalar_type(), "paged_attention_mixed", [&] {
    paged_attention_impl<float, scalar_t>(out.data_ptr<float>(), q.data_ptr<float>(), q_row, k_cache.data_ptr<scalar_t>(),
                                          v_cache.data_ptr<scalar_t>(), table.data_ptr<int32_t>(), seq.data_ptr<int32_t>(),
                                          pos.data_ptr<int32_t>(), n, heads, kv_heads, d, k_cache.size(1), table.size(1),
                                          block_size, static_cast<float>(scale));
  });
  return out;
}

bool decode_bf16_available() {
#ifdef TANDEM_DECODE_BF16
  return true;
#else
  return false;
#endif
}

void register_paged_attention(pybind11::module_& m) {
  m.def("paged_attention", &paged_attention, "attention over paged K/V for queries at given positions");
  m.def("decode_bf16_available", &decode_bf16_available,
        "whether paged_attention runs bfloat16 over a bfloat16 cache on VDPBF16PS here");
}
