// The entry point of Tandem's CPU kernel module: each kernel file defines its ops and registers
// them with a register_* function of its own; the module is the list of those calls. Which file
// holds which ops: the build list, _SOURCES in tandem/runner/kernels.py. Helpers shared by several
// of them are in common.h.
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
