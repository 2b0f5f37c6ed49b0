// ops.cpp: the torch.library schema of the target runtime's ops
// (torch.ops.sharpdraft_cpu_runtime, the extension module sharpdraft_ext._cpu_runtime) and their
// CPU kernels: the linear layers for the few rows of a decode or verification step (float32
// panels, GGUF blocks); llama_layers and the drafters' eagle3_layer, pard_layers and
// dflash_layers, whose kernels register in decoder.cpp, eagle3.cpp, pard.cpp and dflash.cpp. The fake (meta) kernels used by torch.compile live in
// sharpdraft_ext/cpu_runtime/_ops.py and call the check ops below. The attention ops are another
// library, torch.ops.sharpdraft (csrc/attention/ops.cpp), which the fused layers call through
// the dispatcher (decoder_layer.cpp).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "cpu_runtime/api.h"
#include "cpu_runtime/linear_cpu.h"
#include "cpu_runtime/quant_linear.h"

namespace sharpdraft {
namespace {

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, 1, body);
}

// The CPU linear layer for few rows (linear_cpu.h): weight (N, K) float32 -> its panels (P, K,
// panel width); y = x W^T + b from them. Checks name the argument.
at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  check_pack_linear_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor packed = at::empty({cpu::panel_count(n), k, cpu::panel_width()}, w.options());
  cpu::pack_panels(w.data_ptr<float>(), n, k, packed.data_ptr<float>(), parallel_for);
  return packed;
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& bias) {
  check_packed_linear(x, packed, out_features, bias, cpu::panel_width());
  const int64_t k = packed.size(1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const at::Tensor pk = packed.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty({x2.size(0), out_features}, x.options());
  if (x2.size(0) > 0) {
    cpu::panel_linear(x2.data_ptr<float>(), x2.size(0), k, pk.data_ptr<float>(), out_features, k,
                      b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                      out_features, parallel_for);
  }
  return y.view(shape);
}

// The quantised linear layer (quant_linear.h): GGUF blocks (N, K / 32 * bytes) uint8 -> packed
// (panels, K / 32, packed block bytes) uint8; y = x W^T + b from them.
at::Tensor quant_pack_cpu(const at::Tensor& blocks, c10::string_view qtype, int64_t out_features,
                          int64_t in_features) {
  check_quant_pack(blocks, qtype, out_features, in_features);
  const auto t = static_cast<cpu::QuantType>(quant_type_id(qtype));
  const int64_t w = cpu::quant_panel_width();
  const at::Tensor src = blocks.contiguous();
  at::Tensor packed = at::empty({(out_features + w - 1) / w, in_features / 32,
                                 quant_packed_block_bytes(quant_type_id(qtype), w)},
                                blocks.options());
  cpu::pack_quant(t, src.data_ptr<uint8_t>(), out_features, in_features,
                  packed.data_ptr<uint8_t>(), parallel_for);
  return packed;
}

at::Tensor quant_unpack_cpu(const at::Tensor& packed, c10::string_view qtype,
                            int64_t out_features) {
  const at::Tensor x = at::empty({0, packed.size(1) * 32}, packed.options().dtype(at::kFloat));
  check_quant_linear(x, packed, qtype, out_features, std::nullopt, cpu::quant_panel_width());
  const int64_t k = packed.size(1) * 32;
  at::Tensor w = at::empty({out_features, k}, x.options());
  const at::Tensor pk = packed.contiguous();
  cpu::unpack_quant(static_cast<cpu::QuantType>(quant_type_id(qtype)), pk.data_ptr<uint8_t>(),
                    out_features, k, w.data_ptr<float>(), parallel_for);
  return w;
}

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& packed, c10::string_view qtype,
                            int64_t out_features, const std::optional<at::Tensor>& bias) {
  check_quant_linear(x, packed, qtype, out_features, bias, cpu::quant_panel_width());
  const int64_t k = packed.size(1) * 32;
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const at::Tensor pk = packed.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty({x2.size(0), out_features}, x.options());
  if (x2.size(0) > 0) {
    cpu::quant_linear(static_cast<cpu::QuantType>(quant_type_id(qtype)), x2.data_ptr<float>(),
                      x2.size(0), k, pk.data_ptr<uint8_t>(), out_features, k,
                      b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                      out_features, parallel_for);
  }
  return y.view(shape);
}

// The activation quantisation quant_linear applies to each row: x (..., K) float32 ->
// (qx int8 (..., K), dx float32 (..., K / 32), sum of qx int32 (..., K / 32)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations_cpu(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.defined() && x.device().is_cpu() && x.scalar_type() == at::kFloat &&
                        x.dim() >= 1 && x.size(-1) % 32 == 0 && x.size(-1) > 0,
                    "x must be a float32 CPU tensor (..., K) with K a positive multiple of 32");
  const int64_t k = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, k / 32}, x.options());
  at::Tensor s = at::empty({rows, k / 32}, x.options().dtype(at::kInt));
  for (int64_t r = 0; r < rows; ++r) {
    cpu::quantize_row(x2.data_ptr<float>() + r * k, k, q.data_ptr<int8_t>() + r * k,
                      d.data_ptr<float>() + r * (k / 32), s.data_ptr<int32_t>() + r * (k / 32));
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> bshape = shape;
  bshape.back() = k / 32;
  return {q.view(shape), d.view(bshape), s.view(bshape)};
}

}  // namespace

TORCH_LIBRARY(sharpdraft_cpu_runtime, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("panel_width() -> int", [] { return cpu::panel_width(); });
  m.def("quant_pack(Tensor blocks, str qtype, int out_features, int in_features) -> Tensor");
  m.def("quant_unpack(Tensor packed, str qtype, int out_features) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, str qtype, int out_features, Tensor? bias) "
        "-> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_panel_width() -> int", [] { return cpu::quant_panel_width(); });
  m.def("quant_isa() -> str", [] { return std::string(cpu::quant_isa_name()); });
  // The decoder stack on quantised weights (decoder.cpp, which registers its CPU kernel).
  m.def(
      "llama_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] key_cache, Tensor[] value_cache, "
      "int start, Tensor? attn_mask, Tensor[] input_norm, Tensor[] post_norm, Tensor[] qkv, "
      "Tensor[] o_proj, Tensor[] gate_up, Tensor[] down, int[] qtypes, int num_heads, "
      "int num_kv_heads, int head_dim, int intermediate_size, float eps, int[] capture, "
      "Tensor? seq_starts=None) "
      "-> Tensor[]");
  // The EAGLE-3 drafter's layer and head (eagle3.cpp, which registers its CPU kernel).
  m.def(
      "eagle3_layer(Tensor embeds, Tensor hidden, Tensor cos, Tensor sin, Tensor key_cache, "
      "Tensor value_cache, int start, Tensor? attn_mask, Tensor input_norm, Tensor hidden_norm, "
      "Tensor post_norm, Tensor final_norm, Tensor qkv, Tensor o_proj, Tensor gate_up, "
      "Tensor down, Tensor? head, int[] qtypes, int head_size, int num_heads, int num_kv_heads, "
      "int head_dim, int intermediate_size, float eps, str mode, float slope, Tensor? slopes, "
      "int n_ref, int topk, float contrast, float beta_min, float beta_max, int? window=None, "
      "int sinks=0) -> Tensor[]");
  // The PARD drafter's layers and head (pard.cpp, which registers its CPU kernel).
  m.def(
      "pard_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] key_cache, Tensor[] value_cache, "
      "int start, Tensor? attn_mask, Tensor[] input_norm, Tensor[] post_norm, Tensor[] qkv, "
      "Tensor[] o_proj, Tensor[] gate_up, Tensor[] down, int[] qtypes, int num_heads, "
      "int num_kv_heads, int head_dim, int intermediate_size, float eps, Tensor final_norm, "
      "Tensor head, int head_qtype, int head_size, int head_from, str mode, float[] slope, "
      "Tensor?[] slopes, int n_ref, int topk, float contrast, float beta_min, float beta_max) "
      "-> Tensor");
  // The DFlash drafter's block step (dflash.cpp, which registers its CPU kernel).
  m.def(
      "dflash_layers(Tensor block, Tensor cos, Tensor sin, Tensor context, Tensor context_cos, "
      "Tensor context_sin, Tensor fc, int fc_qtype, Tensor hidden_norm, Tensor[] key_cache, "
      "Tensor[] value_cache, int start, Tensor[] input_norm, Tensor[] post_norm, Tensor[] qkv, "
      "Tensor[] kv, Tensor[] o_proj, Tensor[] gate_up, Tensor[] down, int[] qtypes, "
      "Tensor[] q_norm, Tensor[] k_norm, int num_heads, int num_kv_heads, int head_dim, "
      "int intermediate_size, float eps, Tensor final_norm, Tensor head, int head_qtype, "
      "int head_size, int head_from, str mode, float[] slope, Tensor?[] slopes, int n_ref, "
      "int topk, float contrast, float beta_min, float beta_max) -> Tensor");
  // Argument checks only (the meta checks of api.h: no output, no tensor values read): a
  // catch-all kernel, so they run on CPU, meta and fake tensors alike. The fake kernels in
  // sharpdraft_ext/cpu_runtime/_ops.py call them, so torch.compile rejects what eager rejects.
  m.def("check_pack_linear_weight(Tensor weight) -> ()", &check_pack_linear_weight);
  m.def("check_packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
        "int panel_width) -> ()", &check_packed_linear);
  m.def("check_quant_pack(Tensor blocks, str qtype, int out_features, int in_features) -> ()",
        &check_quant_pack);
  m.def("check_quant_linear(Tensor x, Tensor packed, str qtype, int out_features, "
        "Tensor? bias, int panel_width) -> ()", &check_quant_linear);
}

TORCH_LIBRARY_IMPL(sharpdraft_cpu_runtime, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("quant_pack", &quant_pack_cpu);
  m.impl("quant_unpack", &quant_unpack_cpu);
  m.impl("quant_linear", &quant_linear_cpu);
  m.impl("quantize_activations", &quantize_activations_cpu);
}

}  // namespace sharpdraft

#include "common/py_module.h"
SHARPDRAFT_PY_MODULE(_cpu_runtime)
