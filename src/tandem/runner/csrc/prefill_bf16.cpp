// Causal attention of one prefill chunk over its paged context, bfloat16, on CPUs with AVX512-BF16.
//
// The chunk's L queries sit at positions start .. start + L - 1 and see positions 0 .. their own.
// Per kv head, the rows are (query, query head of the group), and the context is walked one KV
// block (16 keys) at a time, flash-attention style: per row an online softmax (running max and
// sum) and a float32 accumulator of the weighted values. Both products run on VDPBF16PS, 32
// multiply-adds per instruction:
//   scores: the block's keys transposed once into 32 vectors of dimension pairs (lane = key), so a
//           row's 16 scores are 32 instructions on broadcast pairs of its query;
//   values: the block's values interleaved once into key pairs (lane = dimension), so a row's
//           weighted sum is 32 instructions on broadcast pairs of its probabilities, rounded to
//           bfloat16 (as SDPA's bfloat16 kernels do).
// The transposes are paid once per block and kv head and shared by every row of the chunk.
// Rows are dealt to the threads by query parity, so both see the same mix of short and long contexts.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TANDEM_PREFILL_BF16 1
#endif

namespace {

#ifdef TANDEM_PREFILL_BF16
constexpr int64_t kKeys = 16;   // keys per pass: one vector of scores

// exp on 16 floats (Cephes polynomial, as exp8 in cpu_ops.cpp); inputs below -88 give ~0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

inline int32_t pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One kv head, the rows of the queries i = first, first + step, ... of the chunk.
// d == 64 (four vectors of 16 dimensions).
void attend_rows(uint16_t* out, const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int32_t* blocks,
                 int64_t start, int64_t len, int64_t first, int64_t step, int64_t heads, int64_t g_size, int64_t h,
                 int64_t bs, float scale) {
  constexpr int64_t d = 64;
  std::vector<int64_t> rows;                        // query index of each row, g fastest
  for (int64_t i = first; i < len; i += step) rows.push_back(i);
  const int64_t nrows = static_cast<int64_t>(rows.size()) * g_size;
  if (nrows == 0) return;
  std::vector<float> acc(nrows * d, 0.f), mx(nrows, -std::numeric_limits<float>::infinity()), sum(nrows, 0.f);
  alignas(64) int32_t kt[d / 2][kKeys];             // [dim pair][key]
  alignas(64) uint16_t vp[kKeys / 2][d][2];         // [key pair][dim][2]
  const int64_t ctx = start + len, last = start + rows.back();   // the longest context of these rows
  for (int64_t t0 = 0; t0 <= last; t0 += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, ctx - t0);
    // Gather the 16 keys' rows (a KV block holds bs >= 16 or a divisor of 16 consecutive positions).
    const uint16_t* krow[kKeys];
    const uint16_t* vrow[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) {
      const int64_t p = t0 + std::min<int64_t>(t, n - 1);
      const int64_t slot = static_cast<int64_t>(blocks[p / bs]) * bs + p % bs;
      krow[t] = kh + slot * d;
      vrow[t] = vh + slot * d;
    }
    for (int64_t t = 0; t < kKeys; ++t)
      for (int64_t p = 0; p < d / 2; ++p) kt[p][t] = pair_at(krow[t] + 2 * p);
    for (int64_t tp = 0; tp < kKeys / 2; ++tp)
      for (int64_t j = 0; j < d; ++j) { vp[tp][j][0] = vrow[2 * tp][j]; vp[tp][j][1] = vrow[2 * tp + 1][j]; }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t i = rows[r / g_size], g = r % g_size, pos = start + i;
      if (t0 > pos) continue;                       // the whole pass is in this query's future
      const uint16_t* qr = q + (i * heads + h * g_size + g) * d;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;    // four chains: the latency of one is long
      for (int64_t p = 0; p < d / 2; p += 4) {
        s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_load_si512(kt[p]), (__m512bh)_mm512_set1_epi32(pair_at(qr + 2 * p)));
        s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_load_si512(kt[p + 1]), (__m512bh)_mm512_set1_epi32(pair_at(qr + 2 * p + 2)));
        s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_load_si512(kt[p + 2]), (__m512bh)_mm512_set1_epi32(pair_at(qr + 2 * p + 4)));
        s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_load_si512(kt[p + 3]), (__m512bh)_mm512_set1_epi32(pair_at(qr + 2 * p + 6)));
      }
      s0 = _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
      const int64_t visible = std::min<int64_t>(n, pos - t0 + 1);
      const __mmask16 mask = visible >= 16 ? 0xffff : static_cast<__mmask16>((1u << visible) - 1);
      const __m512 s = _mm512_mul_ps(s0, sv);
      const float m_old = mx[r], m_new = std::max(m_old, _mm512_mask_reduce_max_ps(mask, s));
      const __m512 pr = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      const float corr = m_new == m_old ? 1.f : std::exp(m_old - m_new);   // 0 on the first pass (m_old = -inf)
      mx[r] = m_new;
      sum[r] = sum[r] * corr + _mm512_reduce_add_ps(pr);
      alignas(64) int32_t pp[kKeys / 2];            // probabilities as bfloat16 pairs
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(pr));
      float* a = acc.data() + r * d;
      const __m512 cv = _mm512_set1_ps(corr);
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a), cv), a1 = _mm512_mul_ps(_mm512_loadu_ps(a + 16), cv);
      __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(a + 32), cv), a3 = _mm512_mul_ps(_mm512_loadu_ps(a + 48), cv);
      __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;      // second set of chains: odd key pairs
      for (int64_t tp = 0; tp < kKeys / 2; tp += 2) {
        const __m512bh pa = (__m512bh)_mm512_set1_epi32(pp[tp]), pb = (__m512bh)_mm512_set1_epi32(pp[tp + 1]);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_load_si512(vp[tp][0]), pa);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_load_si512(vp[tp][16]), pa);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_load_si512(vp[tp][32]), pa);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_load_si512(vp[tp][48]), pa);
        b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_load_si512(vp[tp + 1][0]), pb);
        b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_load_si512(vp[tp + 1][16]), pb);
        b2 = _mm512_dpbf16_ps(b2, (__m512bh)_mm512_load_si512(vp[tp + 1][32]), pb);
        b3 = _mm512_dpbf16_ps(b3, (__m512bh)_mm512_load_si512(vp[tp + 1][48]), pb);
      }
      _mm512_storeu_ps(a, _mm512_add_ps(a0, b0)); _mm512_storeu_ps(a + 16, _mm512_add_ps(a1, b1));
      _mm512_storeu_ps(a + 32, _mm512_add_ps(a2, b2)); _mm512_storeu_ps(a + 48, _mm512_add_ps(a3, b3));
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t i = rows[r / g_size], g = r % g_size;
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    uint16_t* o = out + (i * heads + h * g_size + g) * d;
    for (int64_t c = 0; c < d; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * d + c), inv)));
  }
}
#endif

}  // namespace

bool prefill_bf16_available() {
#ifdef TANDEM_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

// q: bfloat16 [L, H, 64], the chunk's queries at positions start .. start + L - 1; k/v cache:
// bfloat16 [KV, S, 64] (the chunk's own keys already written); blocks: int32 block ids of the
// sequence, covering positions 0 .. start + L - 1. Returns [L, H * 64].
torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks,
                                     int64_t start, int64_t block_size, double scale) {
  TORCH_CHECK(prefill_bf16_available(), "prefill_attention_bf16: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "prefill_attention_bf16: bfloat16 tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && blocks.is_contiguous(),
              "prefill_attention_bf16: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 64 && k_cache.dim() == 3 && k_cache.size(2) == 64,
              "prefill_attention_bf16: head_dim must be 64");
  TORCH_CHECK(blocks.scalar_type() == at::kInt && start >= 0 && block_size > 0,
              "prefill_attention_bf16: int32 block ids, start >= 0, block_size > 0");
  const int64_t len = q.size(0), heads = q.size(1), kv = k_cache.size(0), slots = k_cache.size(1);
  TORCH_CHECK(kv > 0 && heads % kv == 0, "prefill_attention_bf16: heads must be a multiple of kv heads");
  TORCH_CHECK(blocks.numel() * block_size >= start + len, "prefill_attention_bf16: the block table is too short");
  auto out = torch::empty({len, heads * 64}, q.options());
#ifdef TANDEM_PREFILL_BF16
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int32_t* bp = blocks.data_ptr<int32_t>();
  const int64_t g_size = heads / kv, parts = std::min<int64_t>(2, len);
  at::parallel_for(0, kv * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / parts, first = item % parts;
      attend_rows(op, qp, kp + h * slots * 64, vp + h * slots * 64, bp, start, len, first, parts, heads, g_size, h,
                  block_size, static_cast<float>(scale));
    }
  });
#endif
  return out;
}
