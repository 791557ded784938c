// GGUF Q4_1 / Q8_0 linear layers for bfloat16 activations on CPUs with AVX512-BF16, exact to
// float32 accumulation: y = x W^T (+ bias), x and y bfloat16.
//
// A GGUF block holds 32 weights of one row: Q4_1 w = d q + m (q in 0..15), Q8_0 w = d q (q in
// -128..127). Every q is an integer that bfloat16 holds exactly, so per block
//   sum_k w_k x_k = d * sum_k q_k x_k (+ m * sum_k x_k)
// where sum q x runs on VDPBF16PS with exact products, and sum x (per row and block) is computed
// once per call. No weight is ever rounded: this equals the dequantized float32 weights times x,
// up to summation order, and reads 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight, 3.2x / 1.9x fewer
// than bfloat16. A decode step at a few rows is bound by those bytes.
//
// Layout, packed once at load (quant_pack_bf16): groups of 16 output rows; per group and block one
// record: the 16 rows' d (fp16), for Q4_1 their m (fp16), then the q values in the operand order
// of VDPBF16PS, 16 input pairs of 16 rows x 2 values: Q4_1 one byte per (row, pair) holding both
// nibbles, Q8_0 two bytes. The kernel widens a pair step to 32 bfloat16 (a table lookup for
// nibbles, a conversion for bytes) and multiplies it into every row of the tile.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TANDEM_QUANT_BF16 1
#endif

namespace {

constexpr int64_t kGroup = 16, kBlock = 32, kMaxRows = 8;
enum : int64_t { kQ4_1 = 0, kQ8_0 = 1 };

inline int64_t src_block_bytes(int64_t qtype) { return qtype == kQ4_1 ? 20 : 34; }
inline int64_t q_bytes(int64_t qtype) { return qtype == kQ4_1 ? 256 : 512; }       // per group and block
inline int64_t record_bytes(int64_t qtype) { return (qtype == kQ4_1 ? 64 : 32) + q_bytes(qtype); }

#ifdef TANDEM_QUANT_BF16
#define TANDEM_QROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

inline int32_t pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One input pair of 16 rows as 32 bfloat16 weights q (row-major pairs).
template <int64_t Q>
inline __m512bh expand(const uint8_t* q, __m512i lut) {
  if constexpr (Q == kQ4_1) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i idx = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)),
                                        _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xF0)), 12));
    return (__m512bh)_mm512_permutexvar_epi16(idx, lut);
  } else {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
}

// y[r, 16 rows of group] for MR rows of x; sx: [M, blocks] sums of x per block (Q4_1's m term).
template <int64_t Q, int MR>
void tile(uint16_t* y, int64_t ldy, const uint16_t* x, int64_t ldx, const uint8_t* rec, int64_t nb,
          const float* sx, const float* bias, int64_t cols, __m512i lut) {
#define DECL(r) __m512 y##r = _mm512_setzero_ps(); const uint16_t* x##r = x + (MR > r ? r : 0) * ldx;
  TANDEM_QROWS(DECL)
#undef DECL
  const int64_t rb = record_bytes(Q);
  for (int64_t b = 0; b < nb; ++b, rec += rb) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    const uint8_t* q = rec + (Q == kQ4_1 ? 64 : 32);
#define ZERO(r) __m512 a##r = _mm512_setzero_ps();
    TANDEM_QROWS(ZERO)
#undef ZERO
    for (int64_t p = 0; p < kBlock / 2; ++p) {
      const __m512bh w = expand<Q>(q + p * (q_bytes(Q) / 16), lut);
      const int64_t k = b * kBlock + 2 * p;
#define DOT(r) if constexpr (MR > r) a##r = _mm512_dpbf16_ps(a##r, w, (__m512bh)_mm512_set1_epi32(pair(x##r + k)));
      TANDEM_QROWS(DOT)
#undef DOT
    }
#define SCALE(r) if constexpr (MR > r) y##r = _mm512_fmadd_ps(d, a##r, y##r);
    TANDEM_QROWS(SCALE)
#undef SCALE
    if constexpr (Q == kQ4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
#define MIN(r) if constexpr (MR > r) y##r = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), y##r);
      TANDEM_QROWS(MIN)
#undef MIN
    }
  }
  const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#define STORE(r) if constexpr (MR > r) \
    _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(y##r, bv)));
  TANDEM_QROWS(STORE)
#undef STORE
}

template <int64_t Q>
void tile_rows(int64_t rows, uint16_t* y, int64_t ldy, const uint16_t* x, int64_t ldx, const uint8_t* rec, int64_t nb,
               const float* sx, const float* bias, int64_t cols, __m512i lut) {
  switch (rows) {
#define CASE(r) case r + 1: tile<Q, r + 1>(y, ldy, x, ldx, rec, nb, sx, bias, cols, lut); break;
    TANDEM_QROWS(CASE)
#undef CASE
    default: break;
  }
}

template <int64_t Q>
void linear_impl(uint16_t* y, const uint16_t* x, const uint8_t* w, const float* bias, int64_t m, int64_t n, int64_t k) {
  const int64_t nb = k / kBlock, groups = (n + kGroup - 1) / kGroup;
  std::vector<float> sx;
  if (Q == kQ4_1) {
    sx.resize(m * nb);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) {
          const uint32_t bits = static_cast<uint32_t>(x[r * k + b * kBlock + i]) << 16;
          float v;
          std::memcpy(&v, &bits, sizeof v);
          s += v;
        }
        sx[r * nb + b] = s;
      }
  }
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = c10::BFloat16(static_cast<float>(i & 15)).x;
  const __m512i lut = _mm512_load_si512(table);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t c0 = g * kGroup, cols = std::min(kGroup, n - c0);
      const uint8_t* rec = w + g * nb * record_bytes(Q);
      for (int64_t r = 0; r < m; r += kMaxRows)
        tile_rows<Q>(std::min(kMaxRows, m - r), y + r * n + c0, n, x + r * k, k, rec, nb,
                     Q == kQ4_1 ? sx.data() + r * nb : nullptr, bias != nullptr ? bias + c0 : nullptr, cols, lut);
    }
  });
}
#endif

}  // namespace

// GGUF blocks [N, K/32 * block bytes] (uint8, as the file stores them) -> the packed records.
torch::Tensor quant_pack_bf16(torch::Tensor data, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "quant_pack_bf16: qtype must be 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(k % kBlock == 0, "quant_pack_bf16: K must be a multiple of 32");
  data = data.contiguous();
  const int64_t nb = k / kBlock, sb = src_block_bytes(qtype), groups = (n + kGroup - 1) / kGroup;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.size(0) == n && data.size(1) == nb * sb,
              "quant_pack_bf16: data is not [", n, ", ", nb * sb, "] bytes");
  auto out = torch::zeros({groups * nb * record_bytes(qtype)}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t rb = record_bytes(qtype), scales = qtype == kQ4_1 ? 64 : 32;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (g * nb + b) * rb;
        for (int64_t i = 0; i < kGroup && g * kGroup + i < n; ++i) {
          const uint8_t* blk = src + (g * kGroup + i) * nb * sb + b * sb;
          std::memcpy(rec + 2 * i, blk, 2);                               // d
          if (qtype == kQ4_1) std::memcpy(rec + 32 + 2 * i, blk + 2, 2);  // m
          uint8_t* q = rec + scales;
          for (int64_t p = 0; p < kBlock / 2; ++p) {
            const int64_t k0 = 2 * p, k1 = 2 * p + 1;
            if (qtype == kQ4_1) {   // weight j < 16: low nibble of byte j; j >= 16: high nibble of byte j - 16
              auto nib = [&](int64_t j) { return j < 16 ? blk[4 + j] & 0x0F : blk[4 + j - 16] >> 4; };
              q[p * 16 + i] = static_cast<uint8_t>(nib(k0) | (nib(k1) << 4));
            } else {
              q[p * 32 + 2 * i] = blk[2 + k0];
              q[p * 32 + 2 * i + 1] = blk[2 + k1];
            }
          }
        }
      }
  });
  return out;
}

// y = x W^T (+ bias) with W packed by quant_pack_bf16; x: bfloat16 [..., K]; n: W's rows.
torch::Tensor quant_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t qtype,
                                int64_t n) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "quant_linear_bf16: qtype must be 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "quant_linear_bf16: x must be a contiguous bfloat16 CPU tensor");
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(k % kBlock == 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == (n + kGroup - 1) / kGroup * (k / kBlock) * record_bytes(qtype),
              "quant_linear_bf16: w is not a packed [", n, ", ", k, "] weight of this type");
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "quant_linear_bf16: bias size");
    b = bias->to(at::kFloat).contiguous();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
#ifdef TANDEM_QUANT_BF16
  if (m > 0) {
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    if (qtype == kQ4_1) linear_impl<kQ4_1>(yp, xp, w.data_ptr<uint8_t>(), bp, m, n, k);
    else linear_impl<kQ8_0>(yp, xp, w.data_ptr<uint8_t>(), bp, m, n, k);
  }
#else
  TORCH_CHECK(false, "quant_linear_bf16: this CPU (or build) has no AVX512-BF16");
#endif
  return y;
}

void register_quant_bf16(pybind11::module_& m) {
  m.def("quant_pack_bf16", &quant_pack_bf16, "GGML Q4_1 / Q8_0 blocks -> records for quant_linear_bf16");
  m.def("quant_linear_bf16", &quant_linear_bf16, "bfloat16 x @ W^T (+ bias) with W packed by quant_pack_bf16");
}
