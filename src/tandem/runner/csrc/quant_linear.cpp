// Weight-only quantized linear layers on GGML Q4_1 / Q8_0 blocks for float32 activations
// (quant_linear), and the float32 weights the blocks encode (quant_dequantize).
#include "common.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

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

}  // namespace

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

void register_quant_linear(pybind11::module_& m) {
  m.def("quant_linear", &quant_linear, "x @ W^T (+ bias) with W in GGML Q4_1 / Q8_0 blocks");
  m.def("quant_dequantize", &quant_dequantize, "float32 weights of GGML Q4_1 / Q8_0 blocks");
}
