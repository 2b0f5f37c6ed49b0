// pard.cpp: the PARD drafter's forward and head in one call (CPU, quantised weights): the kernel
// of sharpdraft_cpu_runtime::pard_layers (schema in ops.cpp). PARD is a few decoder layers of
// the target's family drafting K tokens in one forward (the committed rows not yet cached, then
// K - 1 mask rows); through the PyTorch modules a draft of 8 rows cost some 11 ms of layers
// (4 of them 4-5 ms of Python and small torch ops) and 6 ms of LM head on a 2-core AVX2 EPYC.
// This runs the maths of sharpdraft.drafters.pard.PARDDrafter.forward and its head:
//
//   for each layer l:  x = layer_l(x)          (decoder_layer.h; SharpDraft attention with
//                                               layer l's slope: scaling[l])
//   logits = head(RMSNorm(x, final_norm))       (rows head_from .. m - 1 only)
//
// so each value is the bits of the modules run on the same quantised weights. Each row's result
// depends on that row and the cache only.
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu_runtime/decoder_layer.h"

namespace sharpdraft {

// Returns the logits (m - head_from, head_size) float32 of rows head_from .. m - 1.
at::Tensor pard_layers_cpu(
    const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList key_cache, at::TensorList value_cache, int64_t start,
    const std::optional<at::Tensor>& attn_mask, at::TensorList input_norm,
    at::TensorList post_norm, at::TensorList qkv, at::TensorList o_proj, at::TensorList gate_up,
    at::TensorList down, at::IntArrayRef qtypes, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate_size, double eps, const at::Tensor& final_norm,
    const at::Tensor& head, int64_t head_qtype, int64_t head_size, int64_t head_from,
    c10::string_view mode, at::ArrayRef<double> slope,
    const c10::List<std::optional<at::Tensor>>& slopes, int64_t n_ref, int64_t topk,
    double contrast, double beta_min, double beta_max) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "x must be a float32 CPU tensor (rows, hidden)");
  const int64_t m = x_in.size(0), H = x_in.size(1);
  const decoder::Geometry g{num_heads, num_kv_heads, head_dim, intermediate_size, eps};
  const decoder::Stack stack{input_norm, post_norm, qkv, o_proj, gate_up, down, qtypes};
  decoder::check_stack(stack, g, H, "pard_layers");
  const int64_t layers = stack.size();
  TORCH_CHECK_VALUE(key_cache.size() == qkv.size() && value_cache.size() == qkv.size() &&
                        static_cast<int64_t>(slope.size()) == layers &&
                        static_cast<int64_t>(slopes.size()) == layers,
                    "pard_layers: one key_cache, value_cache, slope and slopes entry per layer");
  decoder::check_rotary(cos, sin, m, head_dim);
  TORCH_CHECK_VALUE(start >= 0, "start must be >= 0, got ", start);
  at::Tensor x = x_in.contiguous().clone();
  // the head's arguments checked before any work: an empty call of it
  decoder::head_logits(x.narrow(0, 0, 0), 0, final_norm, head, head_qtype, head_size, eps);
  TORCH_CHECK_VALUE(head_from >= 0 && head_from <= m, "head_from must lie in [0, ", m, "], got ",
                    head_from);
  decoder::Rows rows;
  rows.start = start;
  rows.end = start + m;
  rows.attn_mask = attn_mask;
  decoder::Workspace ws(m, H, g, x.options());
  for (int64_t l = 0; l < layers; ++l) {
    decoder::check_cache(key_cache[l], value_cache[l], 1, g, rows.end, l);
  }
  for (int64_t l = 0; l < layers; ++l) {
    const decoder::Scaling scaling = decoder::layer_scaling(mode, slope, slopes, l, n_ref, topk,
                                                            contrast, beta_min, beta_max);
    decoder::run_layer(x, decoder::rms_norm(x, input_norm[l], eps), stack.layer(l), g, cos, sin,
                       key_cache[l], value_cache[l], rows, scaling, ws);
  }
  return decoder::head_logits(x, head_from, final_norm, head, head_qtype, head_size, eps);
}

TORCH_LIBRARY_IMPL(sharpdraft_cpu_runtime, CPU, m) { m.impl("pard_layers", &pard_layers_cpu); }

}  // namespace sharpdraft
