// Dense float32 linear layers on weights packed once into 16-column panels (pack_linear,
// packed_linear).
#include "common.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>

namespace {

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

}  // namespace

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

void register_packed_linear(pybind11::module_& m) {
  m.def("pack_linear", &pack_linear, "float32 [N, K] weights -> [N/16, K, 16] panels for packed_linear");
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with W packed by pack_linear");
}
