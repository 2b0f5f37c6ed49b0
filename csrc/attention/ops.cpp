// ops.cpp: the torch.library schema of the sharpdraft ops and their CPU kernels.
// The CUDA kernels register against the same schema in csrc/attention/cuda/binding.cpp; the fake (meta)
// kernels used by torch.compile live in sharpdraft_ext/_ops.py and call the check ops below.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "attention/api.h"
#include "attention/cpu/sharp_cpu.h"
#include "attention/sharp_math.h"
#include "cpu_runtime/linear_cpu.h"
#include "cpu_runtime/quant_linear.h"

namespace sharpdraft {
namespace {

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, 1, body);
}

void run_cpu(const SharpParams& p) {
  cpu::sharp_attention_forward(p, at::get_num_threads(), parallel_for);
}

std::tuple<at::Tensor, at::Tensor> sharp_attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
    std::optional<int64_t> window, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& kv_lens, std::optional<double> scale, c10::string_view mode,
    double slope, const std::optional<at::Tensor>& slope_per_head, int64_t n_ref, int64_t topk,
    double contrast, double beta_min, double beta_max, const std::optional<at::Tensor>& n_visible) {
  Prepared pr = prepare_dense(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                              slope_per_head, n_ref, topk, contrast, beta_min, beta_max, n_visible);
  run_cpu(pr.params);
  return {pr.out, pr.lse};
}

std::tuple<at::Tensor, at::Tensor> sharp_attention_varlen_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, bool causal, std::optional<int64_t> window,
    std::optional<double> scale, c10::string_view mode, double slope,
    const std::optional<at::Tensor>& slope_per_head, int64_t n_ref, int64_t topk, double contrast,
    double beta_min, double beta_max, const std::optional<at::Tensor>& n_visible) {
  Prepared pr = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, window, scale, mode, slope, slope_per_head, n_ref, topk,
                               contrast, beta_min, beta_max, n_visible);
  run_cpu(pr.params);
  return {pr.out, pr.lse};
}

// n_i of every row (B, Hq, Lq), int64: what the kernel's beta uses.
at::Tensor visible_counts_cpu(const at::Tensor& q, const at::Tensor& k, bool causal,
                              std::optional<int64_t> window,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& kv_lens,
                              const std::optional<at::Tensor>& n_visible) {
  Prepared pr = prepare_dense(q, k, k, causal, window, attn_mask, kv_lens, std::nullopt, "none",
                              0.0, std::nullopt, 1, 0, 1.0, 1.0, 1.0, n_visible);
  at::Tensor counts = at::empty(pr.lse.sizes(), q.options().dtype(at::kLong));
  cpu::visible_counts(pr.params, counts.data_ptr<int64_t>());
  return counts;
}

// beta(n) elementwise (spec §1, §3), float32; with a per-head slope n is (..., Hq, Lq).
at::Tensor query_scale_cpu(const at::Tensor& n, c10::string_view mode, double slope,
                           const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                           int64_t topk, double contrast, double beta_min, double beta_max) {
  ScaleParams sp;
  check_query_scale_meta(n, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min,
                         beta_max, &sp);
  const auto slope_t = detail::slope_tensor(slope_per_head, n.device());
  int64_t hq = 1, lq = 1;
  if (slope_t.has_value()) {
    hq = slope_t->numel();
    lq = n.size(-1);
    sp.slope_per_head = slope_t->data_ptr<float>();
  }
  at::Tensor nl = n.to(at::kLong).contiguous();
  at::Tensor beta = at::empty(n.sizes(), n.options().dtype(at::kFloat));
  const int64_t* np = nl.data_ptr<int64_t>();
  float* bp = beta.data_ptr<float>();
  for (int64_t e = 0; e < nl.numel(); ++e) {
    bp[e] = static_cast<float>(query_scale(np[e], sp, (e / lq) % hq));
  }
  return beta;
}

// The CPU linear layer for few rows (csrc/cpu_runtime/linear_cpu.h): weight (N, K) float32 -> its
// panels (P, K, panel width); y = x W^T + b from them. Checks name the argument.
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

// The quantised linear layer (csrc/cpu_runtime/quant_linear.h): GGUF blocks (N, K / 32 * bytes) uint8
// -> packed (panels, K / 32, packed block bytes) uint8; y = x W^T + b from them.
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

// The check ops: the meta checks of api.h (shapes, dtypes, devices, scalar arguments; never
// tensor values), callable on any tensors, fake and meta ones included. The fake kernels in
// sharpdraft_ext/_ops.py call them, so torch.compile rejects what eager rejects.
void check_sharp_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal, std::optional<int64_t> window,
                           const std::optional<at::Tensor>& attn_mask,
                           const std::optional<at::Tensor>& kv_lens, std::optional<double> scale,
                           c10::string_view mode, double slope,
                           const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                           int64_t topk, double contrast, double beta_min, double beta_max,
                           const std::optional<at::Tensor>& n_visible) {
  check_dense_meta(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                   slope_per_head, n_ref, topk, contrast, beta_min, beta_max, n_visible);
}

void check_sharp_attention_varlen(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, bool causal, std::optional<int64_t> window,
    std::optional<double> scale, c10::string_view mode, double slope,
    const std::optional<at::Tensor>& slope_per_head, int64_t n_ref, int64_t topk, double contrast,
    double beta_min, double beta_max, const std::optional<at::Tensor>& n_visible) {
  check_varlen_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    window, scale, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min,
                    beta_max, n_visible);
}

void check_query_scale(const at::Tensor& n, c10::string_view mode, double slope,
                       const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                       int64_t topk, double contrast, double beta_min, double beta_max) {
  check_query_scale_meta(n, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min,
                         beta_max);
}

}  // namespace

TORCH_LIBRARY(sharpdraft, m) {
  m.def(
      "sharp_attention(Tensor q, Tensor k, Tensor v, bool causal, int? window, Tensor? attn_mask, "
      "Tensor? kv_lens, float? scale, str mode, float slope, Tensor? slope_per_head, int n_ref, "
      "int topk, float contrast, float beta_min, float beta_max, Tensor? n_visible) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "sharp_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, bool causal, int? window, "
      "float? scale, str mode, float slope, Tensor? slope_per_head, int n_ref, int topk, "
      "float contrast, float beta_min, float beta_max, Tensor? n_visible) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "visible_counts(Tensor q, Tensor k, bool causal, int? window, Tensor? attn_mask, "
      "Tensor? kv_lens, Tensor? n_visible) -> Tensor");
  m.def(
      "query_scale(Tensor n, str mode, float slope, Tensor? slope_per_head, int n_ref, int topk, "
      "float contrast, float beta_min, float beta_max) -> Tensor");
  // Argument checks only (no output, no tensor values read): a catch-all kernel, so they run
  // on CPU, CUDA, meta and fake tensors alike.
  m.def(
      "check_sharp_attention(Tensor q, Tensor k, Tensor v, bool causal, int? window, "
      "Tensor? attn_mask, Tensor? kv_lens, float? scale, str mode, float slope, "
      "Tensor? slope_per_head, int n_ref, int topk, float contrast, float beta_min, "
      "float beta_max, Tensor? n_visible) -> ()",
      &check_sharp_attention);
  m.def(
      "check_sharp_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, bool causal, int? window, "
      "float? scale, str mode, float slope, Tensor? slope_per_head, int n_ref, int topk, "
      "float contrast, float beta_min, float beta_max, Tensor? n_visible) -> ()",
      &check_sharp_attention_varlen);
  m.def(
      "check_query_scale(Tensor n, str mode, float slope, Tensor? slope_per_head, int n_ref, "
      "int topk, float contrast, float beta_min, float beta_max) -> ()",
      &check_query_scale);
  m.def("cpu_isa() -> str", [] { return std::string(cpu::isa_name()); });
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("panel_width() -> int", [] { return cpu::panel_width(); });
  m.def("check_packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
        "int panel_width) -> ()", &check_packed_linear);
  m.def("check_pack_linear_weight(Tensor weight) -> ()", &check_pack_linear_weight);
  m.def("quant_pack(Tensor blocks, str qtype, int out_features, int in_features) -> Tensor");
  m.def("quant_unpack(Tensor packed, str qtype, int out_features) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, str qtype, int out_features, Tensor? bias) "
        "-> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_panel_width() -> int", [] { return cpu::quant_panel_width(); });
  m.def("quant_isa() -> str", [] { return std::string(cpu::quant_isa_name()); });
  m.def("check_quant_pack(Tensor blocks, str qtype, int out_features, int in_features) -> ()",
        &check_quant_pack);
  m.def("check_quant_linear(Tensor x, Tensor packed, str qtype, int out_features, "
        "Tensor? bias, int panel_width) -> ()", &check_quant_linear);
}

TORCH_LIBRARY_IMPL(sharpdraft, CPU, m) {
  m.impl("sharp_attention", &sharp_attention_cpu);
  m.impl("sharp_attention_varlen", &sharp_attention_varlen_cpu);
  m.impl("visible_counts", &visible_counts_cpu);
  m.impl("query_scale", &query_scale_cpu);
  m.impl("pack_linear_weight", &pack_linear_weight_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("quant_pack", &quant_pack_cpu);
  m.impl("quant_unpack", &quant_unpack_cpu);
  m.impl("quant_linear", &quant_linear_cpu);
  m.impl("quantize_activations", &quantize_activations_cpu);
}

}  // namespace sharpdraft

#include "common/py_module.h"
SHARPDRAFT_PY_MODULE(_C)
