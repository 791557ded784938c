// Fused CPU kernels for Tandem's runner: the small per-layer ops whose fixed cost dominates a
// decode step on a few cores (RMSNorm with residual add, RoPE, SiLU-and-mul), and paged attention
// that reads K/V blocks in place instead of gathering them into a padded copy.
// Every kernel computes in float32 whatever the storage dtype (float32, bfloat16, float16).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TANDEM_DECODE_BF16 1
#endif
#endif

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }

#ifdef TANDEM_AVX2
// exp on 8 floats (Cephes polynomial, the classic avx_mathfun form): ~1 ulp off expf on [-88, 88].
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

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

// Eight elements at a time in float32 for the element-wise kernels below and paged attention:
// load (ld8: widen), round to the storage dtype and keep float32 (what `static_cast<T>` then `f32`
// does), store (narrow).
// bfloat16 rounds to nearest even with VCVTNEPS2BF16, as c10::BFloat16 does; float16 stays scalar.
#if defined(TANDEM_AVX2) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TANDEM_VEC_BF16 1
#endif
template <typename T>
constexpr bool kVecElementwise = std::is_same_v<T, float>
#ifdef TANDEM_VEC_BF16
                                 || std::is_same_v<T, c10::BFloat16>
#endif
    ;
#ifdef TANDEM_AVX2
// Eight elements as float32: float as is, bfloat16 by a 16-bit shift (exact), float16 by F16C.
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const c10::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#ifdef __F16C__
inline __m256 ld8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
inline __m256 round8(__m256 v, const float*) { return v; }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#ifdef TANDEM_VEC_BF16
inline __m128i narrow8(__m256 v) { return (__m128i)_mm256_cvtneps_pbh(v); }
inline __m256 round8(__m256 v, const c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow8(v)), 16));
}
inline void store8(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow8(v)); }
#endif
#endif

// residual += delta (if given); out = residual * rsqrt(mean(residual^2) + eps) * weight
template <typename T>
void add_rms_norm_impl(T* out, T* x, const T* delta, const T* w, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      float ss = 0.f;
#ifdef TANDEM_AVX2
      if constexpr (kVecElementwise<T>) {
        if (dim % 8 == 0) {
          const T* dr = delta;   // null: no residual add
          __m256 acc = _mm256_setzero_ps();
          for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = ld8(xr + i);
            if (dr != nullptr) {
              v = round8(_mm256_add_ps(v, ld8(dr + r * dim + i)), xr);
              store8(xr + i, v);
            }
            _mm256_storeu_ps(buf.data() + i, v);
            acc = _mm256_fmadd_ps(v, v, acc);
          }
          const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum8(acc) / static_cast<float>(dim) + static_cast<float>(eps)));
          T* o = out + r * dim;
          for (int64_t i = 0; i < dim; i += 8)
            store8(o + i, _mm256_mul_ps(ld8(w + i), round8(_mm256_mul_ps(_mm256_loadu_ps(buf.data() + i), inv), o)));
          continue;
        }
      }
#endif
      if (delta != nullptr) {
        const T* dr = delta + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          T s = static_cast<T>(f32(xr[i]) + f32(dr[i]));   // round to storage like `x + delta`
          xr[i] = s;
        }
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) {
        buf[i] = f32(xr[i]);
        ss += buf[i] * buf[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<T>(f32(w[i]) * static_cast<float>(static_cast<T>(buf[i] * inv)));
    }
  });
}

// In-place rotate-half RoPE: for i < D/2, (a, b) = (x[i], x[i + D/2]) ->
// (a cos_i - b sin_i, b cos_i + a sin_i). cos/sin: [P, D] tables (halves repeated, HF layout).
template <typename T>
void rope_impl(T* x, int64_t n, int64_t row_heads, int64_t heads, int64_t d, const T* cos, const T* sin,
               const int64_t* pos) {
  const int64_t half = d / 2;
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + pos[t] * d;
      const T* s = sin + pos[t] * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + (t * row_heads + h) * d;
        int64_t i = 0;
#ifdef TANDEM_AVX2
        if constexpr (kVecElementwise<T>) {
          for (; i + 8 <= half; i += 8) {
            const __m256 a = ld8(v + i), b = ld8(v + i + half);
            const __m256 ac = round8(_mm256_mul_ps(a, ld8(c + i)), v), bs = round8(_mm256_mul_ps(b, ld8(s + i)), v);
            const __m256 bc = round8(_mm256_mul_ps(b, ld8(c + i + half)), v);
            const __m256 as = round8(_mm256_mul_ps(a, ld8(s + i + half)), v);
            store8(v + i, _mm256_sub_ps(ac, bs));
            store8(v + i + half, _mm256_add_ps(bc, as));
          }
        }
#endif
        for (; i < half; ++i) {
          const float a = f32(v[i]), b = f32(v[i + half]);
          // Same rounding steps as q * cos + rotate_half(q) * sin in the storage dtype.
          const T ac = static_cast<T>(a * f32(c[i])), bs = static_cast<T>(b * f32(s[i]));
          const T bc = static_cast<T>(b * f32(c[i + half])), as = static_cast<T>(a * f32(s[i + half]));
          v[i] = static_cast<T>(f32(ac) - f32(bs));
          v[i + half] = static_cast<T>(f32(bc) + f32(as));
        }
      }
    }
  });
}

// out[r, i] = silu(x[r, i]) * x[r, F + i]
template <typename T>
void silu_and_mul_impl(T* out, const T* x, int64_t rows, int64_t f) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * f;
      const T* u = g + f;
      T* o = out + r * f;
      int64_t i = 0;
#ifdef TANDEM_AVX2
      if constexpr (kVecElementwise<T>) {
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= f; i += 8) {
          const __m256 gv = ld8(g + i);
          const __m256 act = round8(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))), o);
          store8(o + i, _mm256_mul_ps(act, ld8(u + i)));
        }
      }
#endif
      for (; i < f; ++i) {
        const float gv = f32(g[i]);
        const T act = static_cast<T>(gv / (1.f + std::exp(-gv)));
        o[i] = static_cast<T>(f32(act) * f32(u[i]));
      }
    }
  });
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

// K/V are read with ld8 (above): float32, bfloat16 or float16 widened to float32.
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


// ---- Weight-only quantized linear layers (GGML blocks, as a GGUF file stores them) ---------------
// W is [N, K] stored row by row as K/32 blocks of 32 weights:
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles (low nibbles: weights 0-15, high: 16-31);
//                    w = d * q + m.
//   Q8_0 (34 bytes): fp16 d, 32 int8 q; w = d * q.
// y = x W^T (+ bias) for float32 x [M, K]. Each weight row is decoded once into a float32 buffer
// (in L1) and dotted with every input row, so a step reads the quantized bytes once whatever M is:
// a decode step at a few rows is bound by those bytes, 4-7x fewer than float32 weights.
enum QType : int64_t { kQ4_1 = 0, kQ8_0 = 1 };

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(TANDEM_AVX2) && defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) { bits = sign; }
    else { int e = -1; uint32_t m = man; do { ++e; m <<= 1; } while (!(m & 0x400u)); bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13); }
  } else if (exp == 31) { bits = sign | 0x7f800000u | (man << 13); }
  else { bits = sign | ((exp + 112) << 23) | (man << 13); }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline int64_t block_bytes(int64_t qtype) { return qtype == kQ4_1 ? 20 : 34; }

// Decode one row of K weights into out[K] (float32, exactly d * q (+ m) as the GGUF reader computes).
inline void decode_row(float* out, const uint8_t* row, int64_t nb, int64_t qtype) {
  for (int64_t b = 0; b < nb; ++b) {
    float* o = out + b * 32;
    if (qtype == kQ4_1) {
      const uint8_t* blk = row + b * 20;
      const float d = half_to_float(blk), m = half_to_float(blk + 2);
      const uint8_t* qs = blk + 4;
#ifdef TANDEM_AVX2
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i mask = _mm_set1_epi8(0x0f);
      const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv));
      _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv));
      _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv));
#else
      for (int j = 0; j < 16; ++j) { o[j] = d * static_cast<float>(qs[j] & 0x0f) + m; o[j + 16] = d * static_cast<float>(qs[j] >> 4) + m; }
#endif
    } else {
      const uint8_t* blk = row + b * 34;
      const float d = half_to_float(blk);
      const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
#ifdef TANDEM_AVX2
      const __m256 dv = _mm256_set1_ps(d);
      for (int j = 0; j < 32; j += 8) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), dv));
      }
#else
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(qs[j]);
#endif
    }
  }
}

inline float dot(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float s = 0.f;
#ifdef TANDEM_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
  }
  s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

// Four dot products of one input row with four decoded weight rows (w0 + i * k), sharing the loads of x.
inline void dot4(float* out, const float* x, const float* w0, int64_t k) {
  int64_t i = 0;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef TANDEM_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + i), a0);
    a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + k + i), a1);
    a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + 2 * k + i), a2);
    a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + 3 * k + i), a3);
  }
  s[0] = hsum8(a0); s[1] = hsum8(a1); s[2] = hsum8(a2); s[3] = hsum8(a3);
#endif
  for (; i < k; ++i)
    for (int j = 0; j < 4; ++j) s[j] += x[i] * w0[j * k + i];
  for (int j = 0; j < 4; ++j) out[j] = s[j];
}

void quant_linear_impl(float* y, const float* x, const uint8_t* w, const float* bias, int64_t m, int64_t n,
                       int64_t k, int64_t qtype) {
  const int64_t nb = k / 32, rb = nb * block_bytes(qtype);
  // Output rows in groups of four: decode four weight rows (L1-resident), then every input row
  // takes four dot products at once.
  at::parallel_for(0, (n + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> wrows(4 * k);
    float s[4];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o0 = 4 * g, cnt = std::min<int64_t>(4, n - o0);
      for (int64_t j = 0; j < cnt; ++j) decode_row(wrows.data() + j * k, w + (o0 + j) * rb, nb, qtype);
      if (cnt == 4) {
        for (int64_t r = 0; r < m; ++r) {
          dot4(s, x + r * k, wrows.data(), k);
          for (int64_t j = 0; j < 4; ++j) y[r * n + o0 + j] = s[j] + (bias != nullptr ? bias[o0 + j] : 0.f);
        }
      } else {
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < cnt; ++j)
            y[r * n + o0 + j] = dot(x + r * k, wrows.data() + j * k, k) + (bias != nullptr ? bias[o0 + j] : 0.f);
      }
    }
  });
}

// ---- Dense float32 linear layers on packed weights ----------------------------------------------
// W [N, K] is packed once into panels of 16 output columns: panel p holds W[16p .. 16p+15, :] as
// [K][16] (zero-padded past N), so the inner loop reads 16 consecutive floats per k. The microkernel
// keeps a 6x16 tile of y in 12 registers: per k, two loads of W, six broadcasts of x, twelve FMAs.
// A decode step (a few to a few dozen rows) streams each panel from memory once and reuses it
// from L1 for every 6-row tile; larger steps walk x in L2-sized row chunks. BLAS sgemm packs the
// weights on every call, which at these row counts costs more than the arithmetic.
constexpr int64_t kNR = 16, kMR = 6;

inline int64_t panels_of(int64_t n) { return (n + kNR - 1) / kNR; }

#ifdef TANDEM_AVX2
// Named accumulators rather than an array: GCC keeps an array of __m256 in memory and stores it
// every iteration, which made the loop store-bound at a third of the FMA peak.
template <int MR>
inline void tile_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t k,
                     const float* bias, int64_t cols, bool accumulate, const float* pf, int64_t pf_lines) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  // Prefetches into L2, spread evenly over the tile's iterations, so the L1 keeps the block in
  // use and x (its own prefetcher pulls from L2). Measured: prefetching at all saves a third at
  // 8-16 rows; spread into L2 against back to back into L1 was within this VM's noise.
  const int64_t stride = pf_lines > 0 ? std::max<int64_t>(1, k / pf_lines) : k + 1;
  int64_t next_pf = 0, pf_done = 0;
  for (int64_t i = 0; i < k; ++i) {
    if (i == next_pf && pf_done < pf_lines) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + pf_done * kNR), _MM_HINT_T1);
      ++pf_done; next_pf += stride;
    }
    const __m256 w0 = _mm256_loadu_ps(panel + i * kNR), w1 = _mm256_loadu_ps(panel + i * kNR + 8);
    __m256 xv = _mm256_broadcast_ss(x0 + i);
    c00 = _mm256_fmadd_ps(xv, w0, c00); c01 = _mm256_fmadd_ps(xv, w1, c01);
    if constexpr (MR > 1) { xv = _mm256_broadcast_ss(x1 + i); c10 = _mm256_fmadd_ps(xv, w0, c10); c11 = _mm256_fmadd_ps(xv, w1, c11); }
    if constexpr (MR > 2) { xv = _mm256_broadcast_ss(x2 + i); c20 = _mm256_fmadd_ps(xv, w0, c20); c21 = _mm256_fmadd_ps(xv, w1, c21); }
    if constexpr (MR > 3) { xv = _mm256_broadcast_ss(x3 + i); c30 = _mm256_fmadd_ps(xv, w0, c30); c31 = _mm256_fmadd_ps(xv, w1, c31); }
    if constexpr (MR > 4) { xv = _mm256_broadcast_ss(x4 + i); c40 = _mm256_fmadd_ps(xv, w0, c40); c41 = _mm256_fmadd_ps(xv, w1, c41); }
    if constexpr (MR > 5) { xv = _mm256_broadcast_ss(x5 + i); c50 = _mm256_fmadd_ps(xv, w0, c50); c51 = _mm256_fmadd_ps(xv, w1, c51); }
  }
  alignas(32) float t[6][kNR];
  _mm256_store_ps(t[0], c00); _mm256_store_ps(t[0] + 8, c01);
  _mm256_store_ps(t[1], c10); _mm256_store_ps(t[1] + 8, c11);
  _mm256_store_ps(t[2], c20); _mm256_store_ps(t[2] + 8, c21);
  _mm256_store_ps(t[3], c30); _mm256_store_ps(t[3] + 8, c31);
  _mm256_store_ps(t[4], c40); _mm256_store_ps(t[4] + 8, c41);
  _mm256_store_ps(t[5], c50); _mm256_store_ps(t[5] + 8, c51);
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * ldy;
    if (accumulate)
      for (int64_t j = 0; j < cols; ++j) t[r][j] += yr[j];
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) t[r][j] += bias[j];
    std::memcpy(yr, t[r], cols * sizeof(float));
  }
}
#endif

template <int MR>
inline void tile_f32_scalar(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t k,
                            const float* bias, int64_t cols, bool accumulate, const float*, int64_t) {
  float acc[MR][kNR] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * ldx + i];
#pragma omp simd
      for (int j = 0; j < kNR; ++j) acc[r][j] += xv * panel[i * kNR + j];
    }
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j)
      y[r * ldy + j] = acc[r][j] + (accumulate ? y[r * ldy + j] : 0.f) + (bias != nullptr ? bias[j] : 0.f);
}

template <int MR>
inline void tile(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t k,
                 const float* bias, int64_t cols, bool accumulate, const float* pf, int64_t pf_lines) {
#ifdef TANDEM_AVX2
  tile_f32<MR>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines);
#else
  tile_f32_scalar<MR>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines);
#endif
}

inline void tile_rows(int64_t rows, float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t k,
                      const float* bias, int64_t cols, bool accumulate, const float* pf, int64_t pf_lines) {
  switch (rows) {
    case 6: tile<6>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines); break;
    case 5: tile<5>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines); break;
    case 4: tile<4>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines); break;
    case 3: tile<3>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines); break;
    case 2: tile<2>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines); break;
    default: tile<1>(y, ldy, x, ldx, panel, k, bias, cols, accumulate, pf, pf_lines); break;
  }
}

// Loop nest, outermost first: row chunks of x that fit L2; panels (split over threads); K blocks
// of kKC, so a panel's block (16 KB) stays in L1 while every 6-row tile of the chunk passes over
// it; the tiles. A tile after the first K block adds to the partial sums in y; the last adds bias.
constexpr int64_t kKC = 256;
constexpr int64_t kPrefetchLines = 512;      // two blocks (32 KB) ahead in the weight stream

void packed_linear_impl(float* y, const float* x, const float* w, const float* bias, int64_t m, int64_t n, int64_t k) {
  const int64_t np = panels_of(n);
  const int64_t mc = std::max<int64_t>(kMR, (256 * 1024 / (k * 4)) / kMR * kMR);
  for (int64_t m0 = 0; m0 < m; m0 += mc) {
    const int64_t m1 = std::min(m, m0 + mc);
    at::parallel_for(0, np, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = w + p * k * kNR;
        const int64_t c0 = p * kNR, cols = std::min(kNR, n - c0);
        for (int64_t k0 = 0; k0 < k; k0 += kKC) {
          const int64_t kb = std::min(kKC, k - k0);
          const float* b = (bias != nullptr && k0 + kb == k) ? bias + c0 : nullptr;
          // The thread's panels lie back to back, one stream; the tiles share out the prefetch of
          // the block kPrefetchLines ahead in it, so its stream from memory overlaps the arithmetic.
          const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
          const int64_t ahead = p * k + k0 + kPrefetchLines;            // in lines of the stream
          const int64_t next_lines = std::max<int64_t>(0, std::min<int64_t>(kb, end * k - ahead));
          const int64_t share = (next_lines + tiles - 1) / tiles;
          for (int64_t t = 0, r = m0; r < m1; ++t, r += kMR) {
            const int64_t first = std::min(next_lines, t * share), lines = std::min(share, next_lines - first);
            tile_rows(std::min(kMR, m1 - r), y + r * n + c0, n, x + r * k + k0, k, panel + k0 * kNR, kb, b, cols, k0 > 0,
                      lines > 0 ? w + (ahead + first) * kNR : nullptr, lines);
          }
        }
      }
    });
  }
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  check(x, "x");
  check(w, "weight");
  auto out = torch::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* dp = nullptr;
    if (delta.has_value()) { check(*delta, "delta"); dp = delta->data_ptr<scalar_t>(); }
    add_rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), dp, w.data_ptr<scalar_t>(), rows, dim, eps);
  });
  return out;
}

// x: [N, row_heads, D] contiguous; rotates heads [0, num_heads) of every row in place.
void rope_(torch::Tensor x, int64_t num_heads, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  check(x, "x");
  check(cos, "cos");
  check(sin, "sin");
  check(positions, "positions");
  TORCH_CHECK(x.dim() == 3 && num_heads <= x.size(1), "x must be [N, heads, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0), "positions: int64 [N]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_impl<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), num_heads, x.size(2), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>(), positions.data_ptr<int64_t>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check(x, "x");
  const int64_t f = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = f;
  auto out = torch::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rows, f);
  });
  return out;
}

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

// The step's new K and V ([N, KV, D] each, rows may be strided: slices of the fused qkv output)
// into their slots of the caches ([KV, slots, D]), converted to the cache's dtype: one call in
// place of two transposes, two dtype conversions and two index_copy_ per layer.
void kv_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  check(k_cache, "k_cache");
  check(v_cache, "v_cache");
  check(slots, "slot_mapping");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(2),
              "kv_write_: k, v must be [N, kv_heads, head_dim] and the caches [kv_heads, slots, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "kv_write_: slot_mapping must be int64 [N]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "kv_write_: k and v (and their caches) must share a dtype");
  if (k.stride(2) != 1) k = k.contiguous();
  if (v.stride(2) != 1) v = v.contiguous();
  const int64_t n = k.size(0), kvh = k.size(1), d = k.size(2), num_slots = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "kv_write_: slot ", sp[i], " outside the cache's ", num_slots);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "kv_write_src", [&] {
    using TS = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "kv_write_dst", [&] {
      using TD = scalar_t;
      for (int which = 0; which < 2; ++which) {
        const torch::Tensor& src = which == 0 ? k : v;
        TD* dst = (which == 0 ? k_cache : v_cache).data_ptr<TD>();
        const TS* sp0 = src.data_ptr<TS>();
        const int64_t s0 = src.stride(0), s1 = src.stride(1);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < kvh; ++h) {
            const TS* from = sp0 + i * s0 + h * s1;
            TD* to = dst + (h * num_slots + sp[i]) * d;
            for (int64_t j = 0; j < d; ++j) to[j] = static_cast<TD>(static_cast<float>(from[j]));
          }
      }
    });
  });
}

// x: float32 [M, K]; w: uint8 [N, K/32 * block bytes] (GGML blocks); bias: float32 [N] or none.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t qtype) {
  check(x, "x");
  check(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_linear: x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2, "quant_linear: w must be uint8 [N, row bytes]");
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "quant_linear: unsupported block type ", qtype);
  const int64_t k = x.size(-1), m = x.numel() / k, n = w.size(0);
  TORCH_CHECK(k % 32 == 0 && w.size(1) == k / 32 * block_bytes(qtype), "quant_linear: w does not hold [N, K] blocks");
  const float* bp = nullptr;
  if (bias.has_value()) { check(*bias, "bias"); bp = bias->data_ptr<float>(); }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
  quant_linear_impl(y.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<uint8_t>(), bp, m, n, k, qtype);
  return y;
}

// The float32 weights [N, K] the blocks encode (for tests and for the large-batch path).
torch::Tensor quant_dequantize(torch::Tensor w, int64_t k, int64_t qtype) {
  check(w, "w");
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "quant_dequantize: unsupported block type ", qtype);
  const int64_t n = w.size(0), nb = k / 32;
  auto out = torch::empty({n, k}, torch::dtype(torch::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) decode_row(op + o * k, wp + o * nb * block_bytes(qtype), nb, qtype);
  });
  return out;
}

// w: float32 [N, K] -> panels [ceil(N/16), K, 16] for packed_linear.
torch::Tensor pack_linear(torch::Tensor w) {
  check(w, "w");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "pack_linear: w must be float32 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), np = panels_of(n);
  auto out = torch::zeros({np, k, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, np, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kNR && p * kNR + j < n; ++j) {
        const float* row = src + (p * kNR + j) * k;
        float* col = dst + p * k * kNR + j;
        for (int64_t i = 0; i < k; ++i) col[i * kNR] = row[i];
      }
  });
  return out;
}

// y = x W^T (+ bias), W packed by pack_linear; x: float32 [..., K]; n: W's rows.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n) {
  check(x, "x");
  check(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "packed_linear: float32 only");
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(w.dim() == 3 && w.size(0) == panels_of(n) && w.size(1) == k && w.size(2) == kNR,
              "packed_linear: w is not a packed [", n, ", ", k, "] weight");
  const float* bp = nullptr;
  if (bias.has_value()) { check(*bias, "bias"); TORCH_CHECK(bias->numel() == n, "packed_linear: bias size"); bp = bias->data_ptr<float>(); }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
  if (m > 0) packed_linear_impl(y.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), bp, m, n, k);
  return y;
}

// linear_bf16.cpp
bool bf16_linear_available();
torch::Tensor pack_linear_bf16(torch::Tensor w);
torch::Tensor packed_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n);
// quant_bf16.cpp
torch::Tensor quant_pack_bf16(torch::Tensor data, int64_t qtype, int64_t n, int64_t k);
bool i8_linear_available();
torch::Tensor quant_pack_i8(torch::Tensor data, int64_t n, int64_t k, int64_t qtype);
torch::Tensor quant_linear_i8(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n,
                              int64_t qtype);
torch::Tensor quant_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t qtype,
                                int64_t n);
// prefill_bf16.cpp
bool prefill_bf16_available();
torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks,
                                     int64_t start, int64_t block_size, double scale);

// Temperature sampling by inverse CDF, fused: for each listed row of logits [M, V] (float32), the
// first token whose cumulative weight reaches u * total, where the weights are exp(l / t - max)
// (softmax without the division, which the comparison against u * total makes unnecessary) and the
// cumulative sum runs in float64 in vocabulary order, as `inverse_cdf` over `softmax(l / t)` does.
// A zero weight never raises the sum, so a token of probability 0 is never drawn. The unfused path
// spends most of its time on a float64 cumsum that materializes [M, V] doubles: 26 ms of a 64-row
// step on a 2-core AVX2 EPYC, ~4 ms here.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor temps, torch::Tensor u) {
  for (auto* t : {&logits, &rows, &temps, &u}) check(*t, "argument");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2, "sample_rows: logits must be float32 [M, V]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && temps.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble,
              "sample_rows: rows int64, temps float32, u float64");
  const int64_t r = rows.numel(), m_rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(temps.numel() == r && u.numel() == r, "sample_rows: one temperature and one uniform per row");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* tp = temps.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  for (int64_t i = 0; i < r; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < m_rows, "sample_rows: row ", rp[i], " out of range");
    TORCH_CHECK(tp[i] > 0.f, "sample_rows: temperatures must be > 0");
  }
  auto out = torch::empty({r}, torch::dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* lp = logits.data_ptr<float>();
  at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(v);
    for (int64_t i = begin; i < end; ++i) {
      const float* l = lp + rp[i] * v;
      const float t = tp[i];
      int64_t j = 0;
      float mx = -std::numeric_limits<float>::infinity();
#ifdef TANDEM_AVX2
      const __m256 tv = _mm256_set1_ps(t);
      __m256 mv = _mm256_set1_ps(mx);
      for (; j + 8 <= v; j += 8) {
        const __m256 x = _mm256_div_ps(_mm256_loadu_ps(l + j), tv);
        _mm256_storeu_ps(w.data() + j, x);
        mv = _mm256_max_ps(mv, x);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv);
      for (float x : lanes) mx = std::max(mx, x);
#endif
      for (; j < v; ++j) { w[j] = l[j] / t; mx = std::max(mx, w[j]); }
      if (mx == -std::numeric_limits<float>::infinity()) { op[i] = 0; continue; }   // nothing allowed: token 0
      j = 0;
#ifdef TANDEM_AVX2
      const __m256 mxv = _mm256_set1_ps(mx);
      for (; j + 8 <= v; j += 8) _mm256_storeu_ps(w.data() + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(w.data() + j), mxv)));
#endif
      for (; j < v; ++j) w[j] = std::exp(w[j] - mx);
      double total = 0.0;
      for (j = 0; j < v; ++j) total += w[j];
      const double target = up[i] * total;
      double acc = 0.0;
      int64_t tok = v - 1;
      for (j = 0; j < v; ++j) {
        acc += w[j];
        if (acc >= target) { tok = j; break; }
      }
      op[i] = tok;
    }
  });
  return out;
}

// logits: float32 [M, V]; rows: int64 [R]; bits: int32 [R, W] (token t allowed iff bit t % 32 of word
// t / 32 is set, llguidance's layout). Sets logits[rows[i], t] = -inf for every refused t, in place,
// one pass per row with no [R, V] intermediate; tokens past 32 * W are refused too.
void mask_by_bits_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "mask_by_bits_: logits must be contiguous float32 [M, V]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && bits.scalar_type() == at::kInt && bits.dim() == 2 &&
              bits.is_contiguous() && bits.size(0) == rows.numel(), "mask_by_bits_: rows int64 [R], bits int32 [R, W]");
  const int64_t r = rows.numel(), m_rows = logits.size(0), v = logits.size(1), w = bits.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < m_rows, "mask_by_bits_: row ", rp[i], " out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * v;
      const uint32_t* b = bp + i * w;
      for (int64_t word = 0; word * 32 < v; ++word) {
        const uint32_t bitsw = word < w ? b[word] : 0u;
        if (bitsw == 0xffffffffu) continue;
        const int64_t base = word * 32, n = std::min<int64_t>(32, v - base);
        for (int64_t k = 0; k < n; ++k)
          if (!((bitsw >> k) & 1u)) row[base + k] = ninf;
      }
    }
  });
}

void register_decoder_stack(pybind11::module_& m);   // decoder_stack.cpp

bool decode_bf16_available() {
#ifdef TANDEM_DECODE_BF16
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decoder_stack(m);
  m.def("mask_by_bits_", &mask_by_bits_, "in place: -inf where a row's token bitmask refuses the token");
  m.def("sample_rows", &sample_rows, "inverse-CDF draws of temperature-scaled rows of float32 logits");
  m.def("add_rms_norm", &add_rms_norm, "x += delta (optional); return rms_norm(x) * w");
  m.def("rope_", &rope_, "in-place rotate-half RoPE on the first num_heads heads of each row");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :F]) * x[..., F:]");
  m.def("pack_linear", &pack_linear, "float32 [N, K] weights -> [N/16, K, 16] panels for packed_linear");
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with W packed by pack_linear");
  m.def("bf16_linear_available", &bf16_linear_available, "whether pack_linear_bf16 runs here (AVX512-BF16)");
  m.def("pack_linear_bf16", &pack_linear_bf16, "bfloat16 [N, K] weights -> [N/32, K/2, 64] panels");
  m.def("packed_linear_bf16", &packed_linear_bf16, "x @ W^T (+ bias) in bfloat16 with W packed by pack_linear_bf16");
  m.def("quant_pack_bf16", &quant_pack_bf16, "GGML Q4_1 / Q8_0 blocks -> records for quant_linear_bf16");
  m.def("quant_linear_bf16", &quant_linear_bf16, "bfloat16 x @ W^T (+ bias) with W packed by quant_pack_bf16");
  m.def("i8_linear_available", &i8_linear_available, "whether quant_linear_i8 runs here (AVX2 + FMA + F16C)");
  m.def("quant_pack_i8", &quant_pack_i8, "GGML Q4_1 or Q8_0 blocks -> 8-row records for quant_linear_i8");
  m.def("quant_linear_i8", &quant_linear_i8, "x @ W^T (+ bias), W in Q4_1 or Q8_0 records, x rounded to 8 bits per block (Q8_1 / Q8_0)");
  m.def("quant_linear", &quant_linear, "x @ W^T (+ bias) with W in GGML Q4_1 / Q8_0 blocks");
  m.def("quant_dequantize", &quant_dequantize, "float32 weights of GGML Q4_1 / Q8_0 blocks");
  m.def("prefill_bf16_available", &prefill_bf16_available, "whether prefill_attention_bf16 runs here");
  m.def("prefill_attention_bf16", &prefill_attention_bf16, "causal attention of one bfloat16 prefill chunk, paged");
  m.def("kv_write_", &kv_write_, "in place: the step's new K/V rows into their cache slots, in the cache's dtype");
  m.def("paged_attention", &paged_attention, "attention over paged K/V for queries at given positions");
  m.def("decode_bf16_available", &decode_bf16_available,
        "whether paged_attention runs bfloat16 over a bfloat16 cache on VDPBF16PS here");
}
