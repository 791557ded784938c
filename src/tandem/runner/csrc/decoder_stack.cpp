// The decoder layers of a decode-only step in one call: for the steps whose every linear layer runs
// the 8-bit kernel (quant_i8.cpp) and whose attention is the paged decode kernel (a GGUF model at a
// few rows: one stream, or a quantized draft model drafting), the layer loop runs here instead of
// in Python. It calls the very kernels the Python loop calls (add_rms_norm, quant_linear_i8, rope_,
// kv_write_, paged_attention, silu_and_mul), in the same order on the same tensors, so its output
// is bit-identical to tandem.models.llama.LlamaModel.forward; what it saves is the interpreter and
// dispatch time between them, about a third of a one-row step of a 135M-parameter model.
//
// A stack is built once per (model, KV cache): the layers' norm weights and 8-bit records and the
// cache's per-layer K/V tensors are kept (shared, not copied); `forward` takes one step's inputs.

#include <torch/extension.h>

#include <vector>

torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps);
void rope_(torch::Tensor x, int64_t num_heads, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                              torch::Tensor seq, torch::Tensor pos, int64_t block_size, double scale);
void kv_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
torch::Tensor quant_linear_i8(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t n,
                              int64_t qtype);
torch::Tensor quant_linear_i8_parts(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                    std::vector<int64_t> qtypes, std::vector<int64_t> rows);

namespace {

struct Linear8 {
  torch::Tensor records;          // quant_pack_i8's records (a fused layer of mixed types: its parts', flat)
  int64_t n = 0;                  // output features
  std::vector<int64_t> qtypes;    // the record type of each part (one: the whole layer's)
  std::vector<int64_t> rows;      // each part's output features

  torch::Tensor operator()(const torch::Tensor& x) const {
    return qtypes.size() == 1 ? quant_linear_i8(x, records, c10::nullopt, n, qtypes[0])
                              : quant_linear_i8_parts(x, records, c10::nullopt, qtypes, rows);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;
  Linear8 qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, torch::Tensor k_cache, torch::Tensor v_cache,
                 std::vector<torch::Tensor> records, std::vector<int64_t> out_features,
                 std::vector<std::vector<int64_t>> qtypes, std::vector<std::vector<int64_t>> rows) {
    TORCH_CHECK(records.size() == 4 && out_features.size() == 4 && qtypes.size() == 4 && rows.size() == 4,
                "add_layer: qkv, o, gate_up and down: 4 records, sizes, and their parts' types and rows");
    TORCH_CHECK(out_features[0] == (heads_ + 2 * kv_heads_) * head_dim_, "add_layer: qkv has ", out_features[0],
                " outputs for ", heads_, " + 2 x ", kv_heads_, " heads of ", head_dim_);
    Layer l;
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    l.k_cache = k_cache;
    l.v_cache = v_cache;
    Linear8* parts[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(!qtypes[i].empty() && qtypes[i].size() == rows[i].size(), "add_layer: one type per part");
      *parts[i] = Linear8{records[i], out_features[i], qtypes[i], rows[i]};
    }
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the residual stream [N, hidden] after the embedding (updated in place and returned, as
  // LlamaModel.forward's); the first `num_layers` layers run.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                        torch::Tensor slots, torch::Tensor table, torch::Tensor query_seq, torch::Tensor query_pos,
                        int64_t block_size, double scale, int64_t num_layers) const {
    TORCH_CHECK(num_layers >= 1 && num_layers <= this->num_layers(), "forward: num_layers ", num_layers,
                " outside [1, ", this->num_layers(), "]");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "forward: x must be a contiguous [N, hidden] residual stream");
    const int64_t n = x.size(0);
    torch::Tensor h = add_rms_norm(x, c10::nullopt, layers_[0].input_norm, eps_);
    for (int64_t i = 0; i < num_layers; ++i) {
      const Layer& l = layers_[i];
      torch::Tensor qkv = l.qkv(h).view({n, heads_ + 2 * kv_heads_, head_dim_});
      rope_(qkv, heads_ + kv_heads_, cos, sin, positions);
      torch::Tensor q = qkv.narrow(1, 0, heads_);
      kv_write_(l.k_cache, l.v_cache, qkv.narrow(1, heads_, kv_heads_), qkv.narrow(1, heads_ + kv_heads_, kv_heads_),
                slots);
      torch::Tensor attn = paged_attention(q, l.k_cache, l.v_cache, table, query_seq, query_pos, block_size, scale);
      h = add_rms_norm(x, l.o(attn), l.post_norm, eps_);
      torch::Tensor out = l.down(silu_and_mul(l.gate_up(h)));
      if (i + 1 < num_layers) {
        h = add_rms_norm(x, out, layers_[i + 1].input_norm, eps_);
      } else {
        x.add_(out);
      }
    }
    return x;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decoder_stack(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecoderStack>(m, "DecoderStack", "a decode step's decoder layers in one call (see decoder_stack.cpp)")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      // the layers run without the GIL: an overlapped drafter's thread and the verifier's run together
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
}
