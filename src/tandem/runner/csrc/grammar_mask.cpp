// Grammar bitmasks applied to rows of float32 logits in place (mask_by_bits_).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <limits>

// logits: float32 [M, V]; rows: int64 [R]; bits: int32 [R, W] (token t allowed iff bit t % 32 of word
// t / 32 is set, llguidance's layout). Sets logits[rows[i], t] = -inf for every refused t, in place,
// one pass per row with no [R, V] intermediate; tokens past 32 * W are refused too.
void mask_by_bits_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "mask_by_bits_: logits must be contiguous float32 [M, V]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && bits.scalar_type() == at::kInt && bits.dim() == 2 &&
              bits.is_contiguous() && bits.size(0) == rows.numel(), "mask_by_bits_: rows int64 [R], bits int32 [R, W]");
  const int64_t r = rows.numel(), m_rows = logits.size(0), v = logits.size(1), w = bits.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < m_rows, "mask_by_bits_: row ", rp[i], " out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * v;
      const uint32_t* b = bp + i * w;
      for (int64_t word = 0; word * 32 < v; ++word) {
        const uint32_t bitsw = word < w ? b[word] : 0u;
        if (bitsw == 0xffffffffu) continue;
        const int64_t base = word * 32, n = std::min<int64_t>(32, v - base);
        for (int64_t k = 0; k < n; ++k)
          if (!((bitsw >> k) & 1u)) row[base + k] = ninf;
      }
    }
  });
}

void register_grammar_mask(pybind11::module_& m) {
  m.def("mask_by_bits_", &mask_by_bits_, "in place: -inf where a row's token bitmask refuses the token");
}
