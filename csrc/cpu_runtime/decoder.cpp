// decoder.cpp: a Llama-style decoder stack on quantised weights in one call (CPU), for the 1 to
// ~96 rows of a decode or verification step, or one row for each of a batch of sequences (batched
// decoding, `seq_starts`; the corpus generator's loop): per layer RMSNorm, then the shared layer
// of decoder_layer.h (the fused q/k/v projection, rotary embedding, the KV cache write,
// attention with the sharp kernel's mode none, the output projection and residual, RMSNorm, the
// fused gate/up projection, SiLU(gate) * up, the down projection and residual). The maths of
// transformers' LlamaDecoderLayer; the point is the cost around it: one op call a step instead
// of ~40 a layer from Python (measured: about 30 of a 52 ms decode step of SmolLM2-135M went to
// Python and small torch ops).
//
// The CPU kernel of sharpdraft_cpu_runtime::llama_layers (schema in ops.cpp). Each row's result
// depends on that row and the cache only (the lossless engine relies on it): the small ops are
// per row and the linear and attention kernels compute each row alone.
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cpu_runtime/decoder_layer.h"

namespace sharpdraft {

// Returns [the last layer's output (m, H)] + the hidden states asked for in `capture` (0 = the
// input x, i = layer i - 1's output), each (m, H) float32.
std::vector<at::Tensor> llama_layers_cpu(
    const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList key_cache, at::TensorList value_cache, int64_t start,
    const std::optional<at::Tensor>& attn_mask, at::TensorList input_norm,
    at::TensorList post_norm, at::TensorList qkv, at::TensorList o_proj, at::TensorList gate_up,
    at::TensorList down, at::IntArrayRef qtypes, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate_size, double eps, at::IntArrayRef capture,
    const std::optional<at::Tensor>& seq_starts) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "x must be a float32 CPU tensor (rows, hidden)");
  const int64_t m = x_in.size(0), H = x_in.size(1);
  const decoder::Geometry g{num_heads, num_kv_heads, head_dim, intermediate_size, eps};
  const decoder::Stack stack{input_norm, post_norm, qkv, o_proj, gate_up, down, qtypes};
  decoder::check_stack(stack, g, H, "llama_layers");
  TORCH_CHECK_VALUE(key_cache.size() == qkv.size() && value_cache.size() == qkv.size(),
                    "llama_layers: one key_cache and value_cache entry per layer");
  decoder::check_rotary(cos, sin, m, head_dim);
  // Batched decoding (seq_starts given): row r is the next token of sequence r, whose keys and
  // values are batch r of every cache; it is written at position seq_starts[r] and sees the
  // keys 0 .. seq_starts[r]. Otherwise the m rows are one sequence's, written from `start`.
  const bool batched = seq_starts.has_value();
  decoder::Rows rows;
  rows.start = start;
  rows.end = start + m;
  rows.attn_mask = attn_mask;
  at::Tensor starts;
  if (batched) {
    TORCH_CHECK_VALUE(seq_starts->dim() == 1 && seq_starts->size(0) == m &&
                          seq_starts->scalar_type() == at::kLong && seq_starts->device().is_cpu(),
                      "seq_starts must be an int64 CPU tensor (rows,) = (", m, ",)");
    TORCH_CHECK_VALUE(!attn_mask.has_value(), "seq_starts and attn_mask exclude each other");
    starts = seq_starts->contiguous();
    const int64_t lo = starts.min().item<int64_t>(), hi = starts.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0, "seq_starts must be >= 0, got ", lo);
    rows.seq_starts = starts.data_ptr<int64_t>();
    rows.end = hi + 1;
    rows.kv_lens = starts + 1;
  }
  const int64_t cache_batch = batched ? m : 1;
  at::Tensor x = x_in.contiguous().clone();
  decoder::Workspace ws(m, H, g, x.options());
  const decoder::Scaling plain;
  std::vector<at::Tensor> out(1);
  auto keep = [&](int64_t index) {
    for (int64_t c : capture) {
      if (c == index) out.push_back(x.clone());
    }
  };
  keep(0);
  for (int64_t l = 0; l < stack.size(); ++l) {
    decoder::check_cache(key_cache[l], value_cache[l], cache_batch, g, rows.end, l);
    decoder::run_layer(x, decoder::rms_norm(x, input_norm[l], eps), stack.layer(l), g, cos, sin,
                       key_cache[l], value_cache[l], rows, plain, ws);
    keep(l + 1);
  }
  out[0] = x;
  return out;
}

TORCH_LIBRARY_IMPL(sharpdraft_cpu_runtime, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace sharpdraft
