// eagle3.cpp: the EAGLE-3 drafter's layer and head in one call (CPU, quantised weights): the
// kernel of sharpdraft_cpu_runtime::eagle3_layer (schema in ops.cpp). A draft step through the
// PyTorch modules spent about 1.7 ms a row in Python and small torch ops against 0.5 ms of
// linears and 0.4 ms of attention (SmolLM2 drafter, 2k context, AVX2 EPYC); this runs the same
// maths as sharpdraft.drafters.eagle3.Eagle3Drafter.step and its head:
//
//   in = [RMSNorm(embeds, input_norm) ; RMSNorm(hidden, hidden_norm)]      (rows, 2 hidden)
//   x  = hidden + o_proj(attention(q, k, v of in))                 (sharp kernel, `scaling`)
//   x += down(SiLU(gate) * up of RMSNorm(x, post_norm));  normed = RMSNorm(x, final_norm)
//   logits = head(normed)                                          (the draft vocabulary's rows)
//
// with the layer of decoder_layer.h, so each value is the bits of the modules run on the same
// quantised weights. Each row's result depends on that row and the cache only.
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu_runtime/decoder_layer.h"

namespace sharpdraft {

// Returns [normed (m, H), x (m, H)] and, with a head, its logits (m, head_size), float32.
std::vector<at::Tensor> eagle3_layer_cpu(
    const at::Tensor& embeds, const at::Tensor& hidden, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
    int64_t start, const std::optional<at::Tensor>& attn_mask, const at::Tensor& input_norm,
    const at::Tensor& hidden_norm, const at::Tensor& post_norm, const at::Tensor& final_norm,
    const at::Tensor& qkv, const at::Tensor& o_proj, const at::Tensor& gate_up,
    const at::Tensor& down, const std::optional<at::Tensor>& head, at::IntArrayRef qtypes,
    int64_t head_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate_size, double eps, c10::string_view mode, double slope,
    const std::optional<at::Tensor>& slopes, int64_t n_ref, int64_t topk, double contrast,
    double beta_min, double beta_max, std::optional<int64_t> window, int64_t sinks) {
  for (const at::Tensor* t : {&embeds, &hidden}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->scalar_type() == at::kFloat && t->device().is_cpu() &&
                          t->sizes() == embeds.sizes(),
                      t == &embeds ? "embeds" : "hidden",
                      " must be a float32 CPU tensor (rows, hidden), both the same shape");
  }
  const int64_t m = embeds.size(0), H = embeds.size(1), D = head_dim;
  const decoder::Geometry g{num_heads, num_kv_heads, head_dim, intermediate_size, eps};
  const int64_t nq = num_heads * D, nkv = num_kv_heads * D, ffn = intermediate_size;
  TORCH_CHECK_VALUE(static_cast<int64_t>(qtypes.size()) == (head.has_value() ? 5 : 4),
                    "qtypes must give qkv, o_proj, gate_up, down (and head) formats: ",
                    head.has_value() ? 5 : 4, " entries, got ", qtypes.size());
  decoder::check_packed(qkv, qtypes[0], nq + 2 * nkv, 2 * H, "qkv", 0);
  decoder::check_packed(o_proj, qtypes[1], H, nq, "o_proj", 0);
  decoder::check_packed(gate_up, qtypes[2], 2 * ffn, H, "gate_up", 0);
  decoder::check_packed(down, qtypes[3], H, ffn, "down", 0);
  if (head.has_value()) decoder::check_packed(*head, qtypes[4], head_size, H, "head", 0);
  for (const at::Tensor* w : {&input_norm, &hidden_norm, &post_norm, &final_norm}) {
    TORCH_CHECK_VALUE(w->numel() == H && w->scalar_type() == at::kFloat && w->is_contiguous(),
                      "input_norm / hidden_norm / post_norm / final_norm must be contiguous "
                      "float32 (", H, ",)");
  }
  decoder::check_rotary(cos, sin, m, D);
  TORCH_CHECK_VALUE(start >= 0, "start must be >= 0, got ", start);
  decoder::check_cache(key_cache, value_cache, 1, g, start + m, 0);
  TORCH_CHECK_VALUE(!window.has_value() || *window >= 1, "window must be None or >= 1, got ",
                    window.value_or(0));
  TORCH_CHECK_VALUE(sinks >= 0, "sinks must be >= 0, got ", sinks);
  decoder::Rows rows{start, nullptr, start + m, attn_mask, std::nullopt};
  rows.window = window.value_or(-1);
  rows.sinks = sinks;
  const decoder::Scaling scaling{std::string(mode), slope,    slopes,  n_ref,
                                 topk,              contrast, beta_min, beta_max};

  at::Tensor x = hidden.contiguous().clone();
  const at::Tensor in = at::cat({decoder::rms_norm(embeds, input_norm, eps),
                                 decoder::rms_norm(x, hidden_norm, eps)}, 1);
  decoder::Workspace ws(m, H, g, x.options());
  const decoder::LayerWeights w{qkv, o_proj, gate_up, down, post_norm,
                                qtypes[0], qtypes[1], qtypes[2], qtypes[3]};
  decoder::run_layer(x, in, w, g, cos, sin, key_cache, value_cache, rows, scaling, ws);
  at::Tensor normed = decoder::rms_norm(x, final_norm, eps);
  std::vector<at::Tensor> out{normed, x};
  if (head.has_value()) {
    at::Tensor logits = at::empty({m, head_size}, x.options());
    decoder::linear(normed.data_ptr<float>(), m, H, *head, qtypes[4], head_size,
                    logits.data_ptr<float>());
    out.push_back(logits);
  }
  return out;
}

TORCH_LIBRARY_IMPL(sharpdraft_cpu_runtime, CPU, m) { m.impl("eagle3_layer", &eagle3_layer_cpu); }

}  // namespace sharpdraft
