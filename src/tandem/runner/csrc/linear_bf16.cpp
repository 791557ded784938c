// bfloat16 linear layers on CPUs with AVX512-BF16: y = x W^T (+ bias), x and y bfloat16, float32
// accumulation (as oneDNN's bf16 matmul), rounded once to bfloat16 (nearest even).
//
// W [N, K] is packed once into panels of 32 output columns: panel p holds, for each pair of
// inputs (k, k+1), the 32 columns' two weights side by side ([K/2][32][2], zero-padded past N),
// which is the operand layout of VDPBF16PS: one instruction multiplies 16 columns by an input
// pair and adds both products into 16 float32 sums. The microkernel keeps an MR x 32 tile of y in
// 2 MR registers (MR <= 12): per input pair, two loads of W, MR broadcasts of x's pair, 2 MR dot
// instructions. A decode step (a few to a few dozen rows) streams each panel from memory once
// and rereads it from L2 for every further 12-row tile; a prefill walks x in L2-sized row chunks.
// A tile of 10+ rows spends so long on each cache line of its panel that the hardware prefetcher
// falls behind, so it prefetches the panel itself, a few KB ahead; shorter tiles stream at the
// memory's pace without it.
//
// On CPUs with AMX-BF16 a step of kAmxMinRows rows or more runs on the tile unit from the same
// panels: a B tile is 16 input pairs of 16 columns, i.e. half of 16 consecutive panel rows (row
// stride 128 bytes), so the layout serves both paths and the weight is held once. Each block of 32
// rows x 32 columns keeps its sums in four C tiles (rows 0-15 / 16-31 x columns 0-15 / 16-31) and
// per 32 inputs loads two A tiles (x) and two B tiles (the panel); a last group of fewer than 16
// rows is read from a zero-padded copy. Where the tile state is not granted (amx.h) the AVX512-BF16
// path runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TANDEM_BF16_GEMM 1
#endif
#include "amx.h"

namespace {

constexpr int64_t kCols = 32, kMaxRows = 12;
constexpr int64_t kAhead = 32;   // input pairs a tall tile prefetches its panel ahead (4 KB)

inline int64_t panels_of(int64_t n) { return (n + kCols - 1) / kCols; }

#ifdef TANDEM_BF16_GEMM
// Named accumulators (GCC keeps an array of vectors in memory and stores it every iteration).
#define TANDEM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

inline int32_t pair(const uint16_t* p) {   // two bfloat16 inputs as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int MR>
inline void tile(uint16_t* y, int64_t ldy, const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                 const float* bias, int64_t cols) {
#define DECL(r) __m512 a##r = _mm512_setzero_ps(), b##r = a##r; \
  const uint16_t* x##r = x + (MR > r ? r : 0) * ldx;
  TANDEM_ROWS(DECL)
#undef DECL
  for (int64_t i = 0; i < pairs; ++i) {
    if constexpr (MR >= 10) {   // a tall tile computes too long per line for the hardware prefetcher
      _mm_prefetch(reinterpret_cast<const char*>(panel + (i + kAhead) * 2 * kCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (i + kAhead) * 2 * kCols + kCols), _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kCols + kCols);
#define STEP(r) if constexpr (MR > r) { const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair(x##r + 2 * i)); \
    a##r = _mm512_dpbf16_ps(a##r, xv, w0); b##r = _mm512_dpbf16_ps(b##r, xv, w1); }
    TANDEM_ROWS(STEP)
#undef STEP
  }
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = bias0;
  if (bias != nullptr) { bias0 = _mm512_maskz_loadu_ps(m0, bias); bias1 = _mm512_maskz_loadu_ps(m1, bias + 16); }
#define STORE(r) if constexpr (MR > r) { \
    _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a##r, bias0))); \
    _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(b##r, bias1))); }
  TANDEM_ROWS(STORE)
#undef STORE
}

inline void tile_rows(int64_t rows, uint16_t* y, int64_t ldy, const uint16_t* x, int64_t ldx, const uint16_t* panel,
                      int64_t pairs, const float* bias, int64_t cols) {
  switch (rows) {
#define CASE(r) case r + 1: tile<r + 1>(y, ldy, x, ldx, panel, pairs, bias, cols); break;
    TANDEM_ROWS(CASE)
#undef CASE
    default: break;
  }
}

#ifdef TANDEM_AMX
constexpr int64_t kAmxMinRows = 2;    // one row streams the weights as fast on VDPBF16PS

// Tiles 0-3: C (16 rows x 16 float32 sums each); 4-5: A (16 rows x 32 inputs); 6-7: B (16 input pairs
// x 16 columns x 2).
// y rows [0, valid) of one panel's 32 columns from 16 (a0 only) or 32 rows of x (a0, a1: each
// 16 rows with row stride ldx); k a multiple of 32.
void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t ldx, const uint16_t* panel, int64_t k,
               uint16_t* y, int64_t ldy, int64_t valid, const float* bias, int64_t cols, float* buf) {
  _tile_zero(0); _tile_zero(1);
  if (a1 != nullptr) { _tile_zero(2); _tile_zero(3); }
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    const uint16_t* b = panel + k0 * kCols;   // panel row k0 / 2, 2 * kCols values a row
    _tile_loadd(6, b, 4 * kCols);
    _tile_loadd(7, b + kCols, 4 * kCols);
    _tile_loadd(4, a0 + k0, 2 * ldx);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (a1 != nullptr) {
      _tile_loadd(5, a1 + k0, 2 * ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, buf, 4 * kCols);
  _tile_stored(1, buf + 16, 4 * kCols);
  if (a1 != nullptr) { _tile_stored(2, buf + 16 * kCols, 4 * kCols); _tile_stored(3, buf + 16 * kCols + 16, 4 * kCols); }
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = bias0;
  if (bias != nullptr) { bias0 = _mm512_maskz_loadu_ps(m0, bias); bias1 = _mm512_maskz_loadu_ps(m1, bias + 16); }
  for (int64_t r = 0; r < valid; ++r) {
    const float* s = buf + r * kCols;
    _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(s), bias0)));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, m1,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(s + 16), bias1)));
  }
}

void amx_linear(uint16_t* y, const uint16_t* x, const uint16_t* w, const float* bias, int64_t m, int64_t n,
                int64_t k) {
  const int64_t np = panels_of(n), full = m / 16 * 16, tail = m - full;
  std::vector<uint16_t> pad(tail ? 16 * k : 0, 0);   // the last rows, zero-padded to a whole tile
  if (tail) std::memcpy(pad.data(), x + full * k, tail * k * sizeof(uint16_t));
  const int64_t groups = (m + 15) / 16;
  auto group = [&](int64_t g) { return g * 16 < full ? x + g * 16 * k : pad.data(); };
  // Groups per chunk: x's chunk fits half of a 2 MB L2 beside the panel in use.
  const int64_t gc = std::max<int64_t>(2, (1024 * 1024 / (16 * k * 2)) / 2 * 2);
  for (int64_t g0 = 0; g0 < groups; g0 += gc) {
    const int64_t g1 = std::min(groups, g0 + gc);
    at::parallel_for(0, np, 1, [&](int64_t begin, int64_t end) {
      const tandem_amx::Tiles tiles;
      alignas(64) float buf[32 * kCols];
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c0 = p * kCols, cols = std::min(kCols, n - c0);
        const uint16_t* panel = w + p * k * kCols;
        for (int64_t g = g0; g < g1; g += 2) {
          const bool two = g + 1 < g1;
          const int64_t valid = std::min<int64_t>(two ? 32 : 16, m - g * 16);
          amx_block(group(g), two ? group(g + 1) : nullptr, k, panel, k, y + g * 16 * n + c0, n, valid,
                    bias != nullptr ? bias + c0 : nullptr, cols, buf);
        }
      }
    });
  }
}
#endif

void linear_impl(uint16_t* y, const uint16_t* x, const uint16_t* w, const float* bias, int64_t m, int64_t n,
                 int64_t k) {
#ifdef TANDEM_AMX
  if (m >= kAmxMinRows && k % 32 == 0 && tandem_amx::permitted()) return amx_linear(y, x, w, bias, m, n, k);
#endif
  const int64_t np = panels_of(n), pairs = k / 2;
  // Rows per chunk: x's chunk (bf16) fits half of a 512 KB L2, beside the panel in use.
  const int64_t mc = std::max<int64_t>(kMaxRows, (256 * 1024 / (k * 2)) / kMaxRows * kMaxRows);
  for (int64_t r0 = 0; r0 < m; r0 += mc) {
    const int64_t r1 = std::min(m, r0 + mc);
    at::parallel_for(0, np, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c0 = p * kCols, cols = std::min(kCols, n - c0);
        const uint16_t* panel = w + p * k * kCols;
        for (int64_t r = r0; r < r1; r += kMaxRows)
          tile_rows(std::min(kMaxRows, r1 - r), y + r * n + c0, n, x + r * k, k, panel, pairs,
                    bias != nullptr ? bias + c0 : nullptr, cols);
      }
    });
  }
}
#endif

}  // namespace

bool bf16_linear_available() {
#ifdef TANDEM_BF16_GEMM
  return true;
#else
  return false;
#endif
}

bool amx_linear_available() {
#ifdef TANDEM_AMX
  return tandem_amx::permitted();
#else
  return false;
#endif
}

// bfloat16 [N, K] (K even) -> [N/32, K/2, 64] panels for packed_linear_bf16.
torch::Tensor pack_linear_bf16(torch::Tensor w) {
  TORCH_CHECK(bf16_linear_available(), "pack_linear_bf16: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "pack_linear_bf16: w must be a bfloat16 [N, K] CPU tensor");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_linear_bf16: K must be even");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), np = panels_of(n);
  auto out = torch::zeros({np, k / 2, 2 * kCols}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, np, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < n; ++j) {
        const uint16_t* row = src + (p * kCols + j) * k;
        uint16_t* col = dst + p * k * kCols + 2 * j;
        for (int64_t i = 0; i < k / 2; ++i) {
          col[i * 2 * kCols] = row[2 * i];
          col[i * 2 * kCols + 1] = row[2 * i + 1];
        }
      }
  });
  return out;
}

// y = x W^T (+ bias), W packed by pack_linear_bf16; x: bfloat16 [..., K]; n: W's rows.
torch::Tensor packed_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(bf16_linear_available(), "packed_linear_bf16: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "packed_linear_bf16: x must be a contiguous bfloat16 CPU tensor");
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 3 && w.size(0) == panels_of(n) &&
                  w.size(1) * 2 == k && w.size(2) == 2 * kCols,
              "packed_linear_bf16: w is not a packed [", n, ", ", k, "] weight");
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "packed_linear_bf16: bias size");
    b = bias->to(at::kFloat).contiguous();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = torch::empty(sizes, x.options());
#ifdef TANDEM_BF16_GEMM
  if (m > 0)
    linear_impl(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), b.defined() ? b.data_ptr<float>() : nullptr,
                m, n, k);
#endif
  return y;
}

void register_linear_bf16(pybind11::module_& m) {
  m.def("bf16_linear_available", &bf16_linear_available, "whether pack_linear_bf16 runs here (AVX512-BF16)");
  m.def("amx_linear_available", &amx_linear_available,
        "whether packed_linear_bf16 runs steps of 2+ rows (K a multiple of 32) on AMX tiles here");
  m.def("pack_linear_bf16", &pack_linear_bf16, "bfloat16 [N, K] weights -> [N/32, K/2, 64] panels");
  m.def("packed_linear_bf16", &packed_linear_bf16, "x @ W^T (+ bias) in bfloat16 with W packed by pack_linear_bf16");
}
