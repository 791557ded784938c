// Fused CPU kernels for the small per-layer ops whose fixed cost dominates a decode step on a few
// cores: RMSNorm with residual add (add_rms_norm), rotate-half RoPE (rope_) and SiLU-and-mul.
// Every kernel computes in float32 whatever the storage dtype (float32, bfloat16, float16).
#include "common.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// Eight elements at a time in float32 for the element-wise kernels below: load (ld8, in common.h:
// widen), round to the storage dtype and keep float32 (what `static_cast<T>` then `f32` does),
// store (narrow).
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

void register_elementwise(pybind11::module_& m) {
  m.def("add_rms_norm", &add_rms_norm, "x += delta (optional); return rms_norm(x) * w");
  m.def("rope_", &rope_, "in-place rotate-half RoPE on the first num_heads heads of each row");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :F]) * x[..., F:]");
}
