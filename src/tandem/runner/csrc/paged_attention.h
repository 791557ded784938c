// Paged attention's shared pieces: the softmax's exponentials and maximum, and the prefetch of
// scattered K/V blocks (paged_attention.cpp, paged_attention_bf16.h).
#pragma once

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

#ifdef TANDEM_AVX2
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
#endif

}  // namespace
