// Causal attention of one prefill chunk over its paged context, bfloat16, on CPUs with AVX512-BF16.
//
// The chunk's L queries sit at positions start .. start + L - 1 and see positions 0 .. their own.
// Per kv head, the rows are (query, query head of the group), and the context is walked a tile of
// 64 keys at a time, flash-attention style: per row an online softmax (running max and sum) and a
// float32 accumulator of the weighted values. Both products run on VDPBF16PS, 32 multiply-adds per
// instruction:
//   scores: the tile's keys transposed once into 32 x 4 vectors of dimension pairs (lane = key), so
//           a row's 64 scores are 128 instructions on broadcast pairs of its query;
//   values: the tile's values interleaved once into key pairs (lane = dimension), so a row's
//           weighted sum is 128 instructions on broadcast pairs of its probabilities, rounded to
//           bfloat16 (as SDPA's bfloat16 kernels do).
// The rearranged tile is shared by every row of the chunk, four rows at a time (each loaded vector
// feeds four rows' multiply-adds).
// Rows are dealt to the threads by query parity, so both see the same mix of short and long contexts.
// On CPUs with AMX-BF16 both products run on the tile unit instead (attend_rows_amx), 16 rows at a
// time: the rearranged keys are already B tiles of the scores (16 dimension pairs x 16 keys) and the
// interleaved values B tiles of the weighted sum (16 key pairs x 16 dimensions); the softmax stays
// on AVX-512 between the two, and the tile's weighted sum is added to the rescaled accumulator there.
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
#include "amx.h"

namespace {

#ifdef TANDEM_PREFILL_BF16

// exp on 16 floats (Cephes polynomial, as exp8 in common.h); inputs below -88 give ~0.
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

constexpr int64_t kTile = 64;   // keys per tile: four vectors of scores per row
constexpr int64_t kRows = 4;    // rows computed together (register blocking)
constexpr int64_t kDim = 64;    // the head size both kernels cover

// The keys and values of positions t0 .. t0 + n - 1 from the paged cache, rearranged for the two
// products: keys as dimension pairs (kt[pair][key]), values interleaved by key pairs
// (vp[key pair][dim][2]). Slots past n repeat the last key (their probability is 0).
inline void gather_tile(int32_t (*kt)[kTile], uint16_t (*vp)[kDim][2], const uint16_t* kh, const uint16_t* vh,
                        const int32_t* blocks, int64_t t0, int64_t n, int64_t bs) {
  for (int64_t t = 0; t < kTile; ++t) {
    const int64_t p = t0 + std::min<int64_t>(t, n - 1);
    const int64_t slot = static_cast<int64_t>(blocks[p / bs]) * bs + p % bs;
    const uint16_t* kr = kh + slot * kDim;
    const uint16_t* vr = vh + slot * kDim;
    for (int64_t j = 0; j < kDim / 2; ++j) kt[j][t] = pair_at(kr + 2 * j);
    for (int64_t j = 0; j < kDim; ++j) vp[t / 2][j][t % 2] = vr[j];
  }
}

// One row's online-softmax step over a tile: its raw scores s (the first nv vectors hold keys),
// `visible` of the tile's keys in its past. Writes the tile's probabilities, bfloat16, to p (kTile
// values; 0 for keys it does not see), updates the row's running max and sum, and returns the
// factor that rescales its accumulator (1 for a tile wholly in its future).
inline float softmax_row(__m512 (&s)[4], int64_t visible, int64_t nv, __m512 sv, uint16_t* p, float& mx, float& sum) {
  if (visible <= 0) {
    std::memset(p, 0, kTile * sizeof(uint16_t));
    return 1.f;
  }
  __mmask16 mk[4];
  for (int64_t c = 0; c < 4; ++c) {
    const int64_t v = std::min<int64_t>(16, std::max<int64_t>(0, visible - 16 * c));
    mk[c] = v >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << v) - 1);
  }
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m4 = ninf;
  for (int64_t c = 0; c < nv; ++c) {
    s[c] = _mm512_mask_mul_ps(ninf, mk[c], s[c], sv);
    m4 = _mm512_max_ps(m4, s[c]);
  }
  const float m_old = mx, m_new = std::max(m_old, _mm512_reduce_max_ps(m4));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 tot = _mm512_setzero_ps();
  for (int64_t c = 0; c < 4; ++c) {
    const __m512 e = c < nv ? _mm512_maskz_mov_ps(mk[c], exp16(_mm512_sub_ps(s[c], mv))) : _mm512_setzero_ps();
    tot = _mm512_add_ps(tot, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
  }
  const float corr = m_new == m_old ? 1.f : std::exp(m_old - m_new);   // 0 on the first tile (m_old = -inf)
  mx = m_new;
  sum = sum * corr + _mm512_reduce_add_ps(tot);
  return corr;
}

// Each row's output: its accumulator over its softmax sum, rounded to bfloat16.
inline void store_rows(const std::vector<uint16_t*>& row_out, const std::vector<float>& acc,
                       const std::vector<float>& sum, int64_t nrows) {
  for (int64_t r = 0; r < nrows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    for (int64_t c = 0; c < kDim; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_out[r] + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * kDim + c), inv)));
  }
}

// One kv head, the rows of the queries i = first, first + step, ... of the chunk (g fastest).
// d == 64 (four vectors of 16 dimensions). The context is walked a tile of 64 keys at a time; each
// tile's keys and values are rearranged once and then shared by every row, kRows rows at a time:
// a loaded key or value vector feeds kRows multiply-adds, so the loop runs on the multiply-add
// units rather than on loads, and the online softmax's bookkeeping (max, sum, rescaling) is paid
// once per 64 keys per row.
void attend_rows(uint16_t* out, const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int32_t* blocks,
                 int64_t start, int64_t len, int64_t first, int64_t step, int64_t heads, int64_t g_size, int64_t h,
                 int64_t bs, float scale) {
  constexpr int64_t d = 64;
  std::vector<int64_t> row_pos;                     // position of each row
  std::vector<const uint16_t*> row_q;               // its query
  std::vector<uint16_t*> row_out;                   // where its output goes
  for (int64_t i = first; i < len; i += step)
    for (int64_t g = 0; g < g_size; ++g) {
      row_pos.push_back(start + i);
      row_q.push_back(q + (i * heads + h * g_size + g) * d);
      row_out.push_back(out + (i * heads + h * g_size + g) * d);
    }
  const int64_t nrows = static_cast<int64_t>(row_pos.size());
  if (nrows == 0) return;
  const int64_t nblk = (nrows + kRows - 1) / kRows;
  // Pad to whole blocks with copies of the last row (computed, never stored).
  while (static_cast<int64_t>(row_pos.size()) < nblk * kRows) {
    row_pos.push_back(row_pos.back());
    row_q.push_back(row_q.back());
  }
  std::vector<float> acc(nblk * kRows * d, 0.f), mx(nblk * kRows, -std::numeric_limits<float>::infinity()),
      sum(nblk * kRows, 0.f);
  alignas(64) int32_t kt[d / 2][kTile];             // [dim pair][key]
  alignas(64) uint16_t vp[kTile / 2][d][2];         // [key pair][dim][2]
  alignas(64) int32_t pp[kRows][kTile / 2];         // probabilities of each row as bfloat16 pairs
  const int64_t ctx = start + len, last = row_pos[nrows - 1];   // rows ascend: the last sees the most
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t first_blk = 0;                            // blocks before it have seen all their context
  for (int64_t t0 = 0; t0 <= last; t0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, ctx - t0);
    const int64_t nv = (n + 15) / 16;               // score vectors with a key in them
    gather_tile(kt, vp, kh, vh, blocks, t0, n, bs);
    while (first_blk < nblk && row_pos[(first_blk + 1) * kRows - 1] < t0) ++first_blk;
    for (int64_t b = first_blk; b < nblk; ++b) {
      const int64_t r0 = b * kRows;
      // scores: s[r][c] holds keys 16c .. 16c + 15 of row r0 + r
      __m512 s[kRows][4];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < d / 2; ++j) {
        const __m512bh k0 = (__m512bh)_mm512_load_si512(kt[j]), k1 = (__m512bh)_mm512_load_si512(kt[j] + 16);
        const __m512bh k2 = (__m512bh)_mm512_load_si512(kt[j] + 32), k3 = (__m512bh)_mm512_load_si512(kt[j] + 48);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair_at(row_q[r0 + r] + 2 * j));
          s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, qb);
          s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, qb);
          s[r][2] = _mm512_dpbf16_ps(s[r][2], k2, qb);
          s[r][3] = _mm512_dpbf16_ps(s[r][3], k3, qb);
        }
      }
      // online softmax, per row
      float corr[kRows];
      for (int64_t r = 0; r < kRows; ++r)
        corr[r] = softmax_row(s[r], std::min<int64_t>(n, row_pos[r0 + r] - t0 + 1), nv, sv,
                              reinterpret_cast<uint16_t*>(pp[r]), mx[r0 + r], sum[r0 + r]);
      // values: acc[r] = acc[r] * corr + sum over key pairs of probabilities x values
      __m512 a[kRows][4];
      for (int64_t r = 0; r < kRows; ++r) {
        float* ar = acc.data() + (r0 + r) * d;
        const __m512 cv = _mm512_set1_ps(corr[r]);
        for (int64_t c = 0; c < 4; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * c), cv);
      }
      const int64_t npairs = (n + 1) / 2;
      for (int64_t tp = 0; tp < npairs; ++tp) {
        const __m512bh v0 = (__m512bh)_mm512_load_si512(vp[tp][0]), v1 = (__m512bh)_mm512_load_si512(vp[tp][16]);
        const __m512bh v2 = (__m512bh)_mm512_load_si512(vp[tp][32]), v3 = (__m512bh)_mm512_load_si512(vp[tp][48]);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[r][tp]);
          a[r][0] = _mm512_dpbf16_ps(a[r][0], v0, pb);
          a[r][1] = _mm512_dpbf16_ps(a[r][1], v1, pb);
          a[r][2] = _mm512_dpbf16_ps(a[r][2], v2, pb);
          a[r][3] = _mm512_dpbf16_ps(a[r][3], v3, pb);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        float* ar = acc.data() + (r0 + r) * d;
        for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(ar + 16 * c, a[r][c]);
      }
    }
  }
  store_rows(row_out, acc, sum, nrows);
}
#endif

#ifdef TANDEM_AMX
// attend_rows on AMX tiles, 16 rows a block (queries gathered into whole tiles). Tiles 0-3: C (a
// block's 64 scores, then its 64 output dimensions); 4: A (queries, then probabilities); 5: B.
void attend_rows_amx(uint16_t* out, const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int32_t* blocks,
                     int64_t start, int64_t len, int64_t first, int64_t step, int64_t heads, int64_t g_size,
                     int64_t h, int64_t bs, float scale) {
  constexpr int64_t d = 64, R = 16;
  std::vector<int64_t> row_pos;
  std::vector<uint16_t*> row_out;
  std::vector<uint16_t> qbuf;                       // the rows' queries, R to a tile
  for (int64_t i = first; i < len; i += step)
    for (int64_t g = 0; g < g_size; ++g) {
      row_pos.push_back(start + i);
      row_out.push_back(out + (i * heads + h * g_size + g) * d);
      const uint16_t* qr = q + (i * heads + h * g_size + g) * d;
      qbuf.insert(qbuf.end(), qr, qr + d);
    }
  const int64_t nrows = static_cast<int64_t>(row_pos.size());
  if (nrows == 0) return;
  const int64_t nblk = (nrows + R - 1) / R;
  const std::vector<uint16_t> last_q(qbuf.end() - d, qbuf.end());
  while (static_cast<int64_t>(row_pos.size()) < nblk * R) {   // pad with copies of the last row (never stored)
    row_pos.push_back(row_pos.back());
    qbuf.insert(qbuf.end(), last_q.begin(), last_q.end());
  }
  std::vector<float> acc(nblk * R * d, 0.f), mx(nblk * R, -std::numeric_limits<float>::infinity()), sum(nblk * R, 0.f);
  alignas(64) int32_t kt[d / 2][kTile];             // [dim pair][key]: B tiles of the scores
  alignas(64) uint16_t vp[kTile / 2][d][2];         // [key pair][dim][2]: B tiles of the weighted sum
  alignas(64) float sc[R][kTile];                   // a block's scores
  alignas(64) uint16_t pb[R][kTile];                // its probabilities, bfloat16: A tiles
  alignas(64) float ov[R][d];                       // this key tile's weighted sum
  const tandem_amx::Tiles tiles;
  const int64_t ctx = start + len, last = row_pos[nrows - 1];
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t first_blk = 0;
  for (int64_t t0 = 0; t0 <= last; t0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, ctx - t0), nv = (n + 15) / 16;
    gather_tile(kt, vp, kh, vh, blocks, t0, n, bs);
    while (first_blk < nblk && row_pos[(first_blk + 1) * R - 1] < t0) ++first_blk;
    for (int64_t b = first_blk; b < nblk; ++b) {
      const uint16_t* qa = qbuf.data() + b * R * d;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t half = 0; half < 2; ++half) {    // dimensions 32 half .. 32 half + 31
        _tile_loadd(4, qa + 32 * half, 2 * d);
        _tile_loadd(5, &kt[16 * half][0], 4 * kTile);  _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, &kt[16 * half][16], 4 * kTile); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, &kt[16 * half][32], 4 * kTile); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, &kt[16 * half][48], 4 * kTile); _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, &sc[0][0], 4 * kTile); _tile_stored(1, &sc[0][16], 4 * kTile);
      _tile_stored(2, &sc[0][32], 4 * kTile); _tile_stored(3, &sc[0][48], 4 * kTile);
      float corr[R];
      for (int64_t r = 0; r < R; ++r) {             // online softmax, as attend_rows
        __m512 sr[4];
        for (int64_t c = 0; c < 4; ++c) sr[c] = _mm512_load_ps(sc[r] + 16 * c);
        const int64_t row = b * R + r;
        corr[r] = softmax_row(sr, std::min<int64_t>(n, row_pos[row] - t0 + 1), nv, sv, pb[r], mx[row], sum[row]);
      }
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kh2 = 0; kh2 < 2; ++kh2) {       // keys 32 kh2 .. 32 kh2 + 31
        _tile_loadd(4, &pb[0][32 * kh2], 2 * kTile);
        _tile_loadd(5, &vp[16 * kh2][0][0], 4 * d);  _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, &vp[16 * kh2][16][0], 4 * d); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, &vp[16 * kh2][32][0], 4 * d); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, &vp[16 * kh2][48][0], 4 * d); _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, &ov[0][0], 4 * d); _tile_stored(1, &ov[0][16], 4 * d);
      _tile_stored(2, &ov[0][32], 4 * d); _tile_stored(3, &ov[0][48], 4 * d);
      for (int64_t r = 0; r < R; ++r) {
        float* ar = acc.data() + (b * R + r) * d;
        const __m512 cv = _mm512_set1_ps(corr[r]);
        for (int64_t c = 0; c < d; c += 16)
          _mm512_storeu_ps(ar + c, _mm512_fmadd_ps(_mm512_loadu_ps(ar + c), cv, _mm512_load_ps(ov[r] + c)));
      }
    }
  }
  store_rows(row_out, acc, sum, nrows);
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
#ifdef TANDEM_AMX
  const bool amx = tandem_amx::permitted();
#endif
  at::parallel_for(0, kv * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / parts, first = item % parts;
#ifdef TANDEM_AMX
      if (amx) {
        attend_rows_amx(op, qp, kp + h * slots * 64, vp + h * slots * 64, bp, start, len, first, parts, heads, g_size,
                        h, block_size, static_cast<float>(scale));
        continue;
      }
#endif
      attend_rows(op, qp, kp + h * slots * 64, vp + h * slots * 64, bp, start, len, first, parts, heads, g_size, h,
                  block_size, static_cast<float>(scale));
    }
  });
#endif
  return out;
}

void register_prefill_bf16(pybind11::module_& m) {
  m.def("prefill_bf16_available", &prefill_bf16_available, "whether prefill_attention_bf16 runs here");
  m.def("prefill_attention_bf16", &prefill_attention_bf16, "causal attention of one bfloat16 prefill chunk, paged");
}
