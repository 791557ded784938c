// The entry point of Tandem's CPU kernel module: each kernel file defines its ops and registers
// them with a register_* function of its own; the module is the list of those calls.
//   elementwise.cpp      add_rms_norm, rope_, silu_and_mul
//   paged_attention.cpp  paged_attention (float32 / bfloat16 / float16 caches; VDPBF16PS decode),
//                        decode_bf16_available
//   kv_write.cpp         kv_write_
//   quant_linear.cpp     quant_linear, quant_dequantize (GGML Q4_1 / Q8_0, float32 activations)
//   packed_linear.cpp    pack_linear, packed_linear (float32 on 16-column panels)
//   linear_bf16.cpp      bf16_linear_available, pack_linear_bf16, packed_linear_bf16
//   quant_bf16.cpp       quant_pack_bf16, quant_linear_bf16
//   quant_i8.cpp         i8_linear_available, quant_pack_i8, quant_linear_i8
//   prefill_bf16.cpp     prefill_bf16_available, prefill_attention_bf16
//   sampling.cpp         sample_rows
//   grammar_mask.cpp     mask_by_bits_
//   decoder_stack.cpp    DecoderStack
// Helpers shared by several of them are in common.h.
#include <torch/extension.h>

void register_elementwise(pybind11::module_& m);
void register_paged_attention(pybind11::module_& m);
void register_kv_write(pybind11::module_& m);
void register_quant_linear(pybind11::module_& m);
void register_packed_linear(pybind11::module_& m);
void register_linear_bf16(pybind11::module_& m);
void register_quant_bf16(pybind11::module_& m);
void register_quant_i8(pybind11::module_& m);
void register_prefill_bf16(pybind11::module_& m);
void register_sampling(pybind11::module_& m);
void register_grammar_mask(pybind11::module_& m);
void register_decoder_stack(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decoder_stack(m);
  register_grammar_mask(m);
  register_sampling(m);
  register_elementwise(m);
  register_packed_linear(m);
  register_linear_bf16(m);
  register_quant_bf16(m);
  register_quant_i8(m);
  register_quant_linear(m);
  register_prefill_bf16(m);
  register_kv_write(m);
  register_paged_attention(m);
}
