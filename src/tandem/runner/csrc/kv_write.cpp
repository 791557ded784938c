// The step's new K/V rows into their slots of the paged caches, in the cache's dtype (kv_write_).
#include "common.h"

// The step's new K and V ([N, KV, D] each, rows may be strided: slices of the fused qkv output)
// into their slots of the caches ([KV, slots, D]), converted to the cache's dtype: one call in
// place of two transposes, two dtype conversions and two index_copy_ per layer.
void kv_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  check(k_cache, "k_cache");
  check(v_cache, "v_cache");
  check(slots, "slot_mapping");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(2),
              "kv_write_: k, v must be [N, kv_heads, head_dim] and the caches [kv_heads, slots, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "kv_write_: slot_mapping must be int64 [N]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "kv_write_: k and v (and their caches) must share a dtype");
  if (k.stride(2) != 1) k = k.contiguous();
  if (v.stride(2) != 1) v = v.contiguous();
  const int64_t n = k.size(0), kvh = k.size(1), d = k.size(2), num_slots = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "kv_write_: slot ", sp[i], " outside the cache's ", num_slots);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "kv_write_src", [&] {
    using TS = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "kv_write_dst", [&] {
      using TD = scalar_t;
      for (int which = 0; which < 2; ++which) {
        const torch::Tensor& src = which == 0 ? k : v;
        TD* dst = (which == 0 ? k_cache : v_cache).data_ptr<TD>();
        const TS* sp0 = src.data_ptr<TS>();
        const int64_t s0 = src.stride(0), s1 = src.stride(1);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < kvh; ++h) {
            const TS* from = sp0 + i * s0 + h * s1;
            TD* to = dst + (h * num_slots + sp[i]) * d;
            for (int64_t j = 0; j < d; ++j) to[j] = static_cast<TD>(static_cast<float>(from[j]));
          }
      }
    });
  });
}

void register_kv_write(pybind11::module_& m) {
  m.def("kv_write_", &kv_write_, "in place: the step's new K/V rows into their cache slots, in the cache's dtype");
}
