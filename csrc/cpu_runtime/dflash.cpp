// dflash.cpp: the DFlash drafter's draft step in one call (CPU, quantised weights): the kernel of
// sharpdraft_cpu_runtime::dflash_layers (schema in ops.cpp). DFlash drafts a block of b tokens
// in one forward: the last committed token and b - 1 mask tokens attend, without a causal mask,
// to the context's keys (one per committed position, made from the target's hidden states) and
// to each other. This runs the maths of sharpdraft.drafters.dflash.DFlashDrafter.draft_logits:
//
//   ctx = RMSNorm(fc(context features), hidden_norm)                (the new context rows)
//   for each layer l:  its context keys / values from ctx (k/v projections, k norm, rotary at
//                      the context positions) appended to the cache;
//                      x = layer_l(x) over [cached context ; block] (decoder_layer.h, q/k
//                      norms, SharpDraft attention with layer l's slope), the block's keys
//                      written past the context and not kept
//   logits = head(RMSNorm(x, final_norm))                           (rows head_from .. b - 1)
//
// so each value is the bits of the modules run on the same quantised weights.
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu_runtime/decoder_layer.h"

namespace sharpdraft {

// Returns the logits (b - head_from, head_size) float32 of block rows head_from .. b - 1.
at::Tensor dflash_layers_cpu(
    const at::Tensor& block, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& context, const at::Tensor& context_cos, const at::Tensor& context_sin,
    const at::Tensor& fc, int64_t fc_qtype, const at::Tensor& hidden_norm,
    at::TensorList key_cache, at::TensorList value_cache, int64_t start,
    at::TensorList input_norm, at::TensorList post_norm, at::TensorList qkv, at::TensorList kv,
    at::TensorList o_proj, at::TensorList gate_up, at::TensorList down, at::IntArrayRef qtypes,
    at::TensorList q_norm, at::TensorList k_norm, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate_size, double eps, const at::Tensor& final_norm,
    const at::Tensor& head, int64_t head_qtype, int64_t head_size, int64_t head_from,
    c10::string_view mode, at::ArrayRef<double> slope,
    const c10::List<std::optional<at::Tensor>>& slopes, int64_t n_ref, int64_t topk,
    double contrast, double beta_min, double beta_max) {
  for (const at::Tensor* t : {&block, &context}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->scalar_type() == at::kFloat && t->device().is_cpu(),
                      t == &block ? "block" : "context",
                      " must be a float32 CPU tensor (rows, features)");
  }
  const int64_t b = block.size(0), H = block.size(1), tn = context.size(0);
  const int64_t D = head_dim, nkv = num_kv_heads * D;
  const decoder::Geometry g{num_heads, num_kv_heads, head_dim, intermediate_size, eps};
  const decoder::Stack stack{input_norm, post_norm, qkv, o_proj, gate_up, down, qtypes};
  decoder::check_stack(stack, g, H, "dflash_layers");
  const int64_t layers = stack.size();
  const bool qk_norm = !q_norm.empty();
  TORCH_CHECK_VALUE(key_cache.size() == qkv.size() && value_cache.size() == qkv.size() &&
                        kv.size() == qkv.size() && static_cast<int64_t>(slope.size()) == layers &&
                        static_cast<int64_t>(slopes.size()) == layers,
                    "dflash_layers: one key_cache, value_cache, kv, slope and slopes entry per "
                    "layer");
  TORCH_CHECK_VALUE(q_norm.size() == k_norm.size() && (!qk_norm || q_norm.size() == qkv.size()),
                    "q_norm and k_norm must both be empty or hold one weight per layer");
  for (int64_t l = 0; l < layers; ++l) {
    decoder::check_packed(kv[l], qtypes[4 * l], 2 * nkv, H, "kv", l);
    if (!qk_norm) continue;
    for (const at::Tensor* w : {&q_norm[l], &k_norm[l]}) {
      TORCH_CHECK_VALUE(w->numel() == D && w->scalar_type() == at::kFloat && w->is_contiguous(),
                        "q_norm / k_norm [", l, "] must be contiguous float32 (", D, ",)");
    }
  }
  decoder::check_rotary(cos, sin, b, D);
  decoder::check_rotary(context_cos, context_sin, tn, D);
  decoder::check_packed(fc, fc_qtype, H, context.size(1), "fc", 0);
  TORCH_CHECK_VALUE(hidden_norm.numel() == H && hidden_norm.scalar_type() == at::kFloat &&
                        hidden_norm.is_contiguous(),
                    "hidden_norm must be contiguous float32 (", H, ",)");
  TORCH_CHECK_VALUE(start >= 0, "start must be >= 0, got ", start);
  // the head's arguments checked before any work: an empty call of it
  decoder::head_logits(block.narrow(0, 0, 0), 0, final_norm, head, head_qtype, head_size, eps);
  TORCH_CHECK_VALUE(head_from >= 0 && head_from <= b, "head_from must lie in [0, ", b, "], got ",
                    head_from);
  for (int64_t l = 0; l < layers; ++l) {
    decoder::check_cache(key_cache[l], value_cache[l], 1, g, start + tn + b, l);
  }

  // the new context rows' keys and values, every layer
  if (tn > 0) {
    const at::Tensor feats = context.contiguous();
    at::Tensor ctx = at::empty({tn, H}, block.options());
    decoder::linear(feats.data_ptr<float>(), tn, feats.size(1), fc, fc_qtype, H,
                    ctx.data_ptr<float>());
    ctx = decoder::rms_norm(ctx, hidden_norm, eps);
    at::Tensor kv_out = at::empty({tn, 2 * nkv}, block.options());
    decoder::Rows at_context;
    at_context.start = start;
    for (int64_t l = 0; l < layers; ++l) {
      decoder::linear(ctx.data_ptr<float>(), tn, H, kv[l], qtypes[4 * l], 2 * nkv,
                      kv_out.data_ptr<float>());
      float* k = kv_out.data_ptr<float>();
      if (qk_norm) decoder::head_rms_norm(k, tn, num_kv_heads, D, 2 * nkv, k_norm[l], eps);
      decoder::rotary(k, tn, num_kv_heads, D, 2 * nkv, context_cos.data_ptr<float>(),
                      context_sin.data_ptr<float>());
      decoder::write_cache(k, k + nkv, tn, 2 * nkv, g, key_cache[l], value_cache[l], at_context);
    }
  }
  // the block over [context ; block], no causal mask
  decoder::Rows rows;
  rows.start = start + tn;
  rows.end = start + tn + b;
  rows.causal = false;
  at::Tensor x = block.contiguous().clone();
  decoder::Workspace ws(b, H, g, x.options());
  for (int64_t l = 0; l < layers; ++l) {
    const decoder::Scaling scaling = decoder::layer_scaling(mode, slope, slopes, l, n_ref, topk,
                                                            contrast, beta_min, beta_max);
    decoder::LayerWeights w = stack.layer(l);
    if (qk_norm) {
      w.q_norm = &q_norm[l];
      w.k_norm = &k_norm[l];
    }
    decoder::run_layer(x, decoder::rms_norm(x, input_norm[l], eps), w, g, cos, sin,
                       key_cache[l], value_cache[l], rows, scaling, ws);
  }
  return decoder::head_logits(x, head_from, final_norm, head, head_qtype, head_size, eps);
}

TORCH_LIBRARY_IMPL(sharpdraft_cpu_runtime, CPU, m) { m.impl("dflash_layers", &dflash_layers_cpu); }

}  // namespace sharpdraft
