// decoder_layer.h: one Llama-style decoder layer on quantised weights, past its q/k/v input, for
// the ops that run whole layers in C++: the target's stack (llama_layers, decoder.cpp) and the
// drafters' fused steps (eagle3_layer, eagle3.cpp). Each row's result depends on that row and
// the cache only; the small ops run through the same ATen calls as transformers' modules, so a
// fused layer gives the modules' bits.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <cstdint>
#include <optional>
#include <string>

namespace sharpdraft {
namespace decoder {

// The model's attention and MLP geometry.
struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, intermediate_size;
  double eps;
};

// sharpdraft::sharp_attention's scaling arguments (mode .. beta_max; see its schema). The
// default is plain attention (mode "none"), the target's.
struct Scaling {
  std::string mode = "none";
  double slope = 0.0;
  std::optional<at::Tensor> slopes;  // per-head float32 (num_heads,), replaces slope
  int64_t n_ref = 1, topk = 0;
  double contrast = 1.0, beta_min = 1.0, beta_max = 1.0;
};

// One layer's weights: contiguous quant_pack tensors (q/k/v and gate/up side by side), their
// formats (0 q4_0, 1 q4_1, 2 q8_0), the post-attention RMSNorm weight (hidden,) and, for
// attention with per-head q/k RMSNorm (Qwen3, DFlash's qk_norm), those weights (head_dim,).
struct LayerWeights {
  const at::Tensor& qkv;
  const at::Tensor& o_proj;
  const at::Tensor& gate_up;
  const at::Tensor& down;
  const at::Tensor& post_norm;
  int64_t qtype_qkv, qtype_o, qtype_gate_up, qtype_down;
  const at::Tensor* q_norm = nullptr;
  const at::Tensor* k_norm = nullptr;
};

// Where a call's rows go: one sequence's rows written from `start` (seeing the bottom-right
// causal keys, every key when not `causal`, or attn_mask), or with seq_starts (rows,) one row
// per sequence r, batch r of the cache, written at seq_starts[r] and seeing keys
// 0 .. seq_starts[r] (kv_lens).
// A sliding `window` (>= 1; -1: none) keeps, for one sequence, the first `sinks` keys and the
// last window + rows ones (the rows' own last) and the attn_mask's columns with them, as
// sharpdraft.drafters.layers.last_keys does for the drafters' modules.
struct Rows {
  int64_t start = 0;
  const int64_t* seq_starts = nullptr;
  int64_t end = 0;  // keys attended over: start + rows, or max(seq_starts) + 1
  std::optional<at::Tensor> attn_mask;
  std::optional<at::Tensor> kv_lens;
  bool causal = true;
  int64_t window = -1, sinks = 0;
};

// Layer l's scaling from a drafter op's arguments: `mode` and the shared parameters, slope[l],
// and slopes[l] (per-head, replacing slope[l]) where given.
Scaling layer_scaling(c10::string_view mode, at::ArrayRef<double> slope,
                      const c10::List<std::optional<at::Tensor>>& slopes, int64_t l,
                      int64_t n_ref, int64_t topk, double contrast, double beta_min,
                      double beta_max);

// A draft head: logits (m - head_from, head_size) = RMSNorm(x[head_from:], final_norm) W^T
// from quant_pack'ed blocks (checked, as head_from).
at::Tensor head_logits(const at::Tensor& x, int64_t head_from, const at::Tensor& final_norm,
                       const at::Tensor& head, int64_t head_qtype, int64_t head_size,
                       double eps);

// A stack of layers' weights as the ops take them: one entry a layer in every list, 4 qtypes a
// layer (qkv, o_proj, gate_up, down).
struct Stack {
  at::TensorList input_norm, post_norm, qkv, o_proj, gate_up, down;
  at::IntArrayRef qtypes;
  int64_t size() const { return static_cast<int64_t>(qkv.size()); }
  LayerWeights layer(int64_t l) const {
    return {qkv[l], o_proj[l], gate_up[l], down[l], post_norm[l],
            qtypes[4 * l], qtypes[4 * l + 1], qtypes[4 * l + 2], qtypes[4 * l + 3]};
  }
};

// Checks every list's length and every layer's packed weights and norms for hidden size H;
// `op` names the op in the message.
void check_stack(const Stack& s, const Geometry& g, int64_t H, const char* op);

// Checks cos and sin: contiguous float32 (m, head_dim).
void check_rotary(const at::Tensor& cos, const at::Tensor& sin, int64_t m, int64_t head_dim);

// Scratch tensors for m rows, reused across layers.
struct Workspace {
  at::Tensor qkv_out, attn, proj, gate_up;
  Workspace(int64_t m, int64_t hidden, const Geometry& g, const at::TensorOptions& options);
};

// w * (x * rsqrt(mean(x^2) + eps)): LlamaRMSNorm's ATen calls on float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// y (m, n) = x (m, k) W^T from quant_pack'ed blocks, over at::parallel_for.
void linear(const float* x, int64_t m, int64_t k, const at::Tensor& packed, int64_t qtype,
            int64_t n, float* y);

// Checks that p is quant_pack's (n / W, k / 32, block bytes) uint8 tensor for qtype (W the
// panel width); the message names `what` and the layer.
void check_packed(const at::Tensor& p, int64_t qtype, int64_t n, int64_t k, const char* what,
                  int64_t layer);

// Checks a layer's KV cache pair: contiguous (batch, num_kv_heads, >= end, head_dim), float32,
// float16 or bfloat16, both the same dtype.
void check_cache(const at::Tensor& kc, const at::Tensor& vc, int64_t batch, const Geometry& g,
                 int64_t end, int64_t layer);

// Per-head RMSNorm of `heads` heads of head_dim values in each of m rows of x (row stride
// `row_stride` floats), in place, with the ATen calls of rms_norm.
void head_rms_norm(float* x, int64_t m, int64_t heads, int64_t head_dim, int64_t row_stride,
                   const at::Tensor& w, double eps);

// x (m, heads, d) in place: x * cos + rotate_half(x) * sin, cos / sin (m, d), rounded as
// transformers' apply_rotary_pos_emb rounds it.
void rotary(float* x, int64_t m, int64_t heads, int64_t d, int64_t row_stride, const float* cos,
            const float* sin);

// Rows' keys and values (m rows of num_kv_heads * head_dim floats at k and v, row stride
// `row_stride` floats) into the caches at the rows' positions (`rows`), rounded to nearest even
// into a 16-bit cache.
void write_cache(const float* k, const float* v, int64_t m, int64_t row_stride, const Geometry& g,
                 const at::Tensor& key_cache, const at::Tensor& value_cache, const Rows& rows);

// The layer past its input RMSNorm(s): q/k/v = normed (m, K) W_qkv^T, the q/k norms where the
// weights have them, rotary embedding (cos, sin (m, head_dim)), the new keys / values written
// to the cache, attention with `scaling`, then
// x += o_proj(attn); x += down(SiLU(gate) * up) of RMSNorm(x, post_norm). x (m, hidden) float32
// contiguous, updated in place.
void run_layer(at::Tensor& x, const at::Tensor& normed, const LayerWeights& w, const Geometry& g,
               const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const Rows& rows, const Scaling& scaling,
               Workspace& ws);

}  // namespace decoder
}  // namespace sharpdraft
