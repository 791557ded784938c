// Paged attention that reads K/V blocks in place instead of gathering them into a padded copy:
// float32, bfloat16 or float16 caches read as float32 (attend_item), and on CPUs with AVX512-BF16
// bfloat16 queries over a bfloat16 cache on VDPBF16PS (attend_item_bf16).
// Every kernel computes in float32 whatever the storage dtype (float32, bfloat16, float16).
#include "paged_attention_bf16.h"

namespace {

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

#ifdef TANDEM_AVX2
// The sums of eight vectors: [sum(a0), ..., sum(a7)] (a transpose by horizontal adds).
inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
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
#endif  // TANDEM_AVX2

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
