// ops.cpp: the torch.library schema of the attention ops (torch.ops.sharpdraft, the extension
// module sharpdraft_ext._C) and their CPU kernels. The CUDA kernels register against the same
// schema in csrc/attention/cuda/binding.cpp; the fake (meta) kernels used by torch.compile live
// in sharpdraft_ext/_ops.py and call the check ops below. The target runtime's ops are another
// library, torch.ops.sharpdraft_cpu_runtime (csrc/cpu_runtime/ops.cpp).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "attention/api.h"
#include "attention/cpu/sharp_cpu.h"
#include "attention/sharp_math.h"

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
}

TORCH_LIBRARY_IMPL(sharpdraft, CPU, m) {
  m.impl("sharp_attention", &sharp_attention_cpu);
  m.impl("sharp_attention_varlen", &sharp_attention_varlen_cpu);
  m.impl("visible_counts", &visible_counts_cpu);
  m.impl("query_scale", &query_scale_cpu);
}

}  // namespace sharpdraft

#include "common/py_module.h"
SHARPDRAFT_PY_MODULE(_C)
