// GGUF linear layers with 8-bit activations, as llama.cpp computes them (Q4_1 weights times
// Q8_1 activations): y = x W^T (+ bias), x and y float32 or both bfloat16, on any CPU with AVX2.
//
// A Q4_1 block holds 32 weights of one row, w = d q + m with q in 0..15. Each call quantizes x per
// row and block of 32 (llama.cpp's Q8_1: dx = max|x| / 127, qx = round(x / dx), sx = dx sum qx), so
//   sum_k w_k x_k ~= d dx sum_k q_k qx_k + m sx
// where sum q qx is an exact integer dot product: VPMADDUBSW multiplies 32 unsigned q by 32 signed
// qx into 16 pair sums, which stay exact when a block's eight of them are added in 16 bits
// (16 x 15 x 127 = 30,480 < 32,767). The only rounding is of x to 8 bits per block (relative error
// ~0.5% per layer, llama.cpp's); weights are never rounded.
//
// Why: on a 2-core AVX2 EPYC a float32 GEMM is bound by its FMAs (8 multiply-adds per
// instruction); VPMADDUBSW does 32. Per block and row the kernel spends 8 VPMADDUBSW, 8 adds and 5
// instructions of scaling on 256 multiply-adds, about half the instructions of float32, and it
// reads 0.625 bytes per weight (GGML's own) instead of 4.
//
// Q8_0 blocks (w = d q, q in -127..127; the default model's tied embeddings / LM head) take x
// rounded the same way, as llama.cpp's Q8_0 x Q8_0 does: VPMADDUBSW needs one unsigned operand, so
// it multiplies |q| by qx carrying q's sign (VPSIGNB), and each vector's pair sums go to 32 bits
// at once (2 x 127 x 127 fits 16 bits, four of them would not).
//
// Layout, packed once at load (quant_pack_i8): groups of 8 output rows; per group and block one
// record. Q4_1, 160 bytes: 4 vectors of 32 bytes, vector v holding, for row j of the group, the q of
// inputs 4v..4v+3 (low nibbles) and 16+4v..16+4v+3 (high nibbles) in bytes 4j..4j+3; then the 8
// rows' d and then their m as float16 (the blocks' own bits: GGML's 20 bytes per 32 weights).
// Broadcasting 4 bytes of qx against a vector gives 8 rows' partial dot products at once, lane j
// for row j. Q8_0, 272 bytes: 8 vectors, vector v holding row j's q of
// inputs 4v..4v+3 in bytes 4j..4j+3, then the 8 rows' d as float16. Q6_K and Q4_K run from their
// own bits (quant_i8_kquant.h). The shared helpers (rounding x, the Q4 block's dot products, the
// record sizes) are in quant_i8.h.
#include "quant_i8.h"
#include "quant_i8_kquant.h"

#include <algorithm>
#include <vector>

namespace {

#ifdef TANDEM_QUANT_I8
// MR rows of qx against one group's Q4_1 records: 8 outputs per row.
template <int MR, typename Y>
inline void tile_q4_1(Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* sx,
                 const uint8_t* rec, const float* bias, int64_t cols) {
  const int64_t nb = k / kBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nb; ++b, rec += record_bytes(kQ4_1)) {
    prefetch_ahead<3>(rec);     // a 160-byte record spans up to 3 lines
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 128)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 144)));
    block_q4<MR>(rec, qx + b * kBlock, k, d, m, dx + b, sx + b, nb, a0, a1, a2, a3);
  }
  store_tile_q4<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

// MR rows of qx against one group's Q8_0 records: 8 outputs per row.
template <int MR, typename Y>
inline void tile_q8_0(Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* /*sx*/,
                      const uint8_t* rec, const float* bias, int64_t cols) {
  const int64_t nb = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nb; ++b, rec += record_bytes(kQ8_0)) {
    const int8_t* x0 = qx + b * kBlock;
    prefetch_ahead<5>(rec);     // 272-byte records straddle up to 5 lines
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int v = 0; v < 8; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * v));
      const __m256i aw = _mm256_abs_epi8(wv);
#define TANDEM_I8_ROW(R, S)                                                                           \
      if constexpr (MR > R) {                                                                         \
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(x0 + R * k + 4 * v), wv)); \
        S = _mm256_add_epi32(S, _mm256_madd_epi16(p, ones));                                          \
      }
      TANDEM_I8_ROW(0, s0) TANDEM_I8_ROW(1, s1) TANDEM_I8_ROW(2, s2) TANDEM_I8_ROW(3, s3)
#undef TANDEM_I8_ROW
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256)));
#define TANDEM_I8_FIN(R, A, S)                                                                        \
    if constexpr (MR > R) A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(dx[R * nb + b])), A);
    TANDEM_I8_FIN(0, a0, s0) TANDEM_I8_FIN(1, a1, s1) TANDEM_I8_FIN(2, a2, s2) TANDEM_I8_FIN(3, a3, s3)
#undef TANDEM_I8_FIN
  }
  store_tile<MR>(y, ldy, a0, a1, a2, a3, bias, cols);
}

template <int MR, typename Y>
inline void tile(int qtype, Y* y, int64_t ldy, const int8_t* qx, int64_t k, const float* dx, const float* sx,
                 const uint8_t* rec, const float* bias, int64_t cols) {
  if (qtype == kQ4_1) tile_q4_1<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
  else if (qtype == kQ8_0) tile_q8_0<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
  else if (qtype == kQ6_K) tile_q6_k<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
  else tile_q4_k<MR>(y, ldy, qx, k, dx, sx, rec, bias, cols);
}
#endif

}  // namespace

bool i8_linear_available() {
#ifdef TANDEM_QUANT_I8
  return true;
#else
  return false;
#endif
}

// GGML Q4_1 (qtype 0), Q8_0 (qtype 1), Q6_K (qtype 2) or Q4_K (qtype 3) blocks uint8 [N, K/32 * 20 |
// K/32 * 34 | K/256 * 210 | K/256 * 144] -> uint8 [ceil(N/8), K/32 * 160 | 272 | 224 | K/256 * 1184]
// records (rows past N zero).
torch::Tensor quant_pack_i8(torch::Tensor data, int64_t n, int64_t k, int64_t qtype) {
  TORCH_CHECK(valid_qtype(qtype), "quant_pack_i8: qtype must be 0 (Q4_1), 1 (Q8_0), 2 (Q6_K) or 3 (Q4_K), got ", qtype);
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.scalar_type() == at::kByte && data.dim() == 2,
              "quant_pack_i8: data must be contiguous uint8 [N, row bytes] on CPU");
  const int64_t src_row = source_row_bytes(qtype, k), record = record_bytes(static_cast<int>(qtype));
  TORCH_CHECK(k % (k_quant(qtype) ? kSuper : kBlock) == 0 && data.size(0) == n && data.size(1) == src_row,
              "quant_pack_i8: data does not hold [N, K] ", qtype_name(qtype), " blocks");
#ifndef TANDEM_QUANT_I8
  TORCH_CHECK(false, "quant_pack_i8: this build has no AVX2 + FMA + F16C");
#else
  const int64_t nb = k / kBlock, groups = (n + kGroup - 1) / kGroup, src_block = source_block_bytes(static_cast<int>(qtype));
  auto out = torch::zeros({groups, group_bytes(static_cast<int>(qtype), k)}, torch::dtype(torch::kUInt8));
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (qtype == kQ6_K) {
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      uint8_t q[kSuper];
      float dsc[16];
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j)
          for (int64_t sb = 0; sb < k / kSuper; ++sb) {
            decode_q6_k(src + (g * kGroup + j) * src_row + sb * kQ6_KBytes, q, dsc);
            for (int64_t t = 0; t < kSuper / kBlock; ++t)
              pack_q6_k_row(dst + (g * nb + sb * (kSuper / kBlock) + t) * record, j, q + kBlock * t, dsc[2 * t],
                            dsc[2 * t + 1]);
          }
    });
    return out;
  }
  if (qtype == kQ4_K) {
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j)
          for (int64_t sb = 0; sb < k / kSuper; ++sb)
            pack_q4_k_row(dst + (g * (k / kSuper) + sb) * record, j, src + (g * kGroup + j) * src_row + sb * kQ4_KBytes);
    });
    return out;
  }
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (g * nb + b) * record;
        uint16_t dm[2][kGroup] = {};      // the blocks' float16 d (and m), 8 rows side by side
        for (int64_t j = 0; j < kGroup && g * kGroup + j < n; ++j) {
          const uint8_t* blk = src + (g * kGroup + j) * nb * src_block + b * src_block;
          std::memcpy(&dm[0][j], blk, 2);
          if (qtype == kQ4_1) {
            std::memcpy(&dm[1][j], blk + 2, 2);
            // GGML order: byte i holds weight i (low nibble) and weight i + 16 (high nibble)
            uint8_t q[kBlock];
            for (int i = 0; i < 16; ++i) { q[i] = blk[4 + i] & 0x0F; q[i + 16] = blk[4 + i] >> 4; }
            for (int v = 0; v < 4; ++v)
              for (int t = 0; t < 4; ++t)
                rec[32 * v + 4 * j + t] = static_cast<uint8_t>(q[4 * v + t] | (q[16 + 4 * v + t] << 4));
          } else {
            for (int v = 0; v < 8; ++v) std::memcpy(rec + 32 * v + 4 * j, blk + 2 + 4 * v, 4);
          }
        }
        if (qtype == kQ4_1) std::memcpy(rec + 128, dm, sizeof(dm));
        else std::memcpy(rec + 256, dm[0], sizeof(dm[0]));
      }
  });
  return out;
#endif
}

// A layer's output rows as segments of one record type each (one segment, or a fused layer whose
// parts' GGUF types differ, as a Q4_K_M file's q/k/v do where v is Q6_K): the segments' records lie
// back to back in `w`.
namespace {

struct Segment {
  int q;                 // record type
  int64_t rows;          // output rows
  int64_t first_group;   // index of its first group of 8 rows among all segments' groups
  int64_t col;           // its first output column
  int64_t offset;        // byte offset of its records in w
};

std::vector<Segment> segments(const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t k) {
  std::vector<Segment> out;
  int64_t group = 0, col = 0, offset = 0;
  for (size_t i = 0; i < qtypes.size(); ++i) {
    const int q = static_cast<int>(qtypes[i]);
    out.push_back(Segment{q, rows[i], group, col, offset});
    const int64_t groups = (rows[i] + kGroup - 1) / kGroup;
    group += groups;
    col += rows[i];
    offset += groups * group_bytes(q, k);
  }
  return out;
}

}  // namespace

#ifdef TANDEM_QUANT_I8
template <typename T>
void linear_i8(const T* xp, T* yp, int64_t m, int64_t k, int64_t n, const std::vector<Segment>& segs,
               const uint8_t* wp, const float* bp) {
  const int64_t nb = k / kBlock;
  int64_t groups = 0;
  for (const Segment& s : segs) groups += (s.rows + kGroup - 1) / kGroup;
  std::vector<int8_t> qx(m * k);
  std::vector<float> dx(m * nb), sx(m * nb);
  if (m == 1) {
    quantize_row(xp, k, qx.data(), dx.data(), sx.data());    // no thread hand-off for one row
  } else {
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * k, k, qx.data() + r * k, dx.data() + r * nb, sx.data() + r * nb);
    });
  }
  for (int64_t c0 = 0; c0 < m; c0 += kChunkRows) {
    const int64_t c1 = std::min(m, c0 + kChunkRows);
    at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
      size_t si = 0;
      for (int64_t g = g0; g < g1; ++g) {
        while (si + 1 < segs.size() && g >= segs[si + 1].first_group) ++si;
        const Segment& s = segs[si];
        const int q = s.q;
        const uint8_t* rec = wp + s.offset + (g - s.first_group) * group_bytes(q, k);
        const int64_t col = s.col + (g - s.first_group) * kGroup, cols = std::min(kGroup, s.col + s.rows - col);
        const float* bg = bp != nullptr ? bp + col : nullptr;
        int64_t r = c0;
        for (; r + 4 <= c1; r += 4)
          tile<4>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
        const int64_t left = c1 - r;
        if (left == 0) continue;
        if (left == 3) tile<3>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
        else if (left == 2) tile<2>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
        else tile<1>(q, yp + r * n + col, n, qx.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, rec, bg, cols);
      }
    });
  }
}
#endif

namespace {

torch::Tensor run_linear_i8(torch::Tensor x, const uint8_t* wp, c10::optional<torch::Tensor> bias, int64_t n,
                            const std::vector<Segment>& segs) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  x = x.contiguous();
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  torch::Tensor b32;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && (bias->scalar_type() == at::kFloat || bias->scalar_type() == x.scalar_type()),
                "quant_linear_i8: bias must be [N], float32 or x's dtype");
    b32 = bias->to(at::kFloat).contiguous();
    bp = b32.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
#ifndef TANDEM_QUANT_I8
  TORCH_CHECK(false, "quant_linear_i8: this build has no AVX2 + FMA + F16C");
#else
  if (bf16) linear_i8(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), m, k, n, segs, wp, bp);
  else linear_i8(x.data_ptr<float>(), y.data_ptr<float>(), m, k, n, segs, wp, bp);
#endif
  return y;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_i8: x must be float32 or bfloat16 on CPU");
}

}  // namespace

// x: float32 or bfloat16 [..., K]; w: quant_pack_i8's records of `qtype`; bias: [N] (float32, or
// x's dtype) or none. Returns [..., N] in x's dtype (bfloat16 rounded once, from the float32 sums).
torch::Tensor quant_linear_i8(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n,
                              int64_t qtype) {
  TORCH_CHECK(valid_qtype(qtype), "quant_linear_i8: qtype must be 0 (Q4_1), 1 (Q8_0), 2 (Q6_K) or 3 (Q4_K), got ", qtype);
  check_x(x);
  const int q = static_cast<int>(qtype);
  const int64_t k = x.size(-1), groups = (n + kGroup - 1) / kGroup;
  TORCH_CHECK(k % (k_quant(q) ? kSuper : kBlock) == 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 2 && w.size(0) == groups && w.size(1) == group_bytes(q, k),
              "quant_linear_i8: w does not hold quant_pack_i8 records for [N, K]");
  return run_linear_i8(x, w.data_ptr<uint8_t>(), bias, n, segments({qtype}, {n}, k));
}

// A fused layer whose parts have different record types: w is the parts' quant_pack_i8 records,
// each flattened, back to back (uint8 [total bytes]); part i has rows[i] output rows of type
// qtypes[i]. The same arithmetic as quant_linear_i8 on each part, one output.
torch::Tensor quant_linear_i8_parts(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                    std::vector<int64_t> qtypes, std::vector<int64_t> rows) {
  check_x(x);
  TORCH_CHECK(!qtypes.empty() && qtypes.size() == rows.size(), "quant_linear_i8_parts: one type per part");
  const int64_t k = x.size(-1);
  int64_t n = 0, bytes = 0;
  for (size_t i = 0; i < qtypes.size(); ++i) {
    TORCH_CHECK(valid_qtype(qtypes[i]) && rows[i] > 0, "quant_linear_i8_parts: part ", i, " has type ", qtypes[i],
                " and ", rows[i], " rows");
    TORCH_CHECK(k % (k_quant(qtypes[i]) ? kSuper : kBlock) == 0, "quant_linear_i8_parts: K = ", k, " does not fit ",
                qtype_name(qtypes[i]), " blocks");
    n += rows[i];
    bytes += (rows[i] + kGroup - 1) / kGroup * group_bytes(static_cast<int>(qtypes[i]), k);
  }
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == bytes,
              "quant_linear_i8_parts: w does not hold the parts' quant_pack_i8 records for K = ", k);
  return run_linear_i8(x, w.data_ptr<uint8_t>(), bias, n, segments(qtypes, rows, k));
}

void register_quant_i8(pybind11::module_& m) {
  m.def("i8_linear_available", &i8_linear_available, "whether quant_linear_i8 runs here (AVX2 + FMA + F16C)");
  m.def("quant_pack_i8", &quant_pack_i8, "GGML Q4_1, Q8_0, Q6_K or Q4_K blocks -> 8-row records for quant_linear_i8");
  m.def("quant_linear_i8", &quant_linear_i8, "x @ W^T (+ bias), W in Q4_1, Q8_0, Q6_K or Q4_K records, x rounded to 8 bits per block (Q8_1 / Q8_0)");
  m.def("quant_linear_i8_parts", &quant_linear_i8_parts, "quant_linear_i8 over a fused layer whose parts' record types differ");
}
