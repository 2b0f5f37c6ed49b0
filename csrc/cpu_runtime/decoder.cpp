// decoder.cpp: a Llama-style decoder stack on quantised weights in one call (CPU), for the 1 to
// ~96 rows of a decode or verification step, or one row for each of a batch of sequences (batched
// decoding, `seq_starts`; the corpus generator's loop): per layer RMSNorm, the fused q/k/v
// projection, rotary embedding, the KV cache write, attention (the sharp kernel with mode none),
// the output projection and residual, RMSNorm, the fused gate/up projection, SiLU(gate) * up, the
// down projection and residual. The maths of transformers' LlamaDecoderLayer; the point is the cost
// around it: one op call a step instead of ~40 a layer from Python (measured: about 30 of a 52 ms
// decode step of SmolLM2-135M went to Python and small torch ops).
//
// The CPU kernel of sharpdraft_cpu_runtime::llama_layers (schema in ops.cpp). Each row's result
// depends on that row and the cache only (the lossless engine relies on it): the small ops are
// per row and the linear and attention kernels compute each row alone. The attention is the
// attention library's op (sharpdraft::sharp_attention, sharpdraft_ext._C), called through the
// dispatcher: the kernel is not compiled into this extension.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_runtime/api.h"
#include "cpu_runtime/quant_linear.h"

namespace sharpdraft {
namespace {

void parallel_panels(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, 1, body);
}

// y (m, n) = x (m, k) W^T from packed blocks.
void linear(const float* x, int64_t m, int64_t k, const at::Tensor& packed, int64_t qtype,
            int64_t n, float* y) {
  cpu::quant_linear(static_cast<cpu::QuantType>(qtype), x, m, k, packed.data_ptr<uint8_t>(), n, k,
                    nullptr, y, n, parallel_panels);
}

// Plain attention (mode "none") through sharpdraft::sharp_attention's CPU kernel: bottom-right
// causal without a mask, else the mask; kv_lens limits each batch's keys. Returns out. Called
// below autograd: the op's autograd formula is Python (sharpdraft_ext/_ops.py) and would take
// the GIL once a layer, for outputs nothing differentiates.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& attn_mask,
                     const std::optional<at::Tensor>& kv_lens) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("sharpdraft::sharp_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
              std::optional<int64_t>, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, std::optional<double>, c10::string_view, double,
              const std::optional<at::Tensor>&, int64_t, int64_t, double, double, double,
              const std::optional<at::Tensor>&)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return std::get<0>(op.call(q, k, v, /*causal=*/!attn_mask.has_value(), std::nullopt, attn_mask,
                             kv_lens, std::nullopt, "none", 0.0, std::nullopt, 1, 0, 1.0, 1.0,
                             1.0, std::nullopt));
}

// RMSNorm and SiLU(gate) * up through the same ATen ops as transformers' LlamaRMSNorm and
// LlamaMLP, so that each value is the same bits as in the modules: an int8 activation on a
// rounding boundary would otherwise move by a whole step in one path only.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

// x (m, heads, d) in place: x * cos + rotate_half(x) * sin, cos / sin (m, d).
__attribute__((optimize("fp-contract=off")))  // a * c - b * s rounded as the modules round it
void rotary(float* x, int64_t m, int64_t heads, int64_t d, int64_t row_stride, const float* cos,
            const float* sin) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < m; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* v = x + r * row_stride + hh * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

}  // namespace

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
  const int64_t layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "x must be a float32 CPU tensor (rows, hidden)");
  TORCH_CHECK_VALUE(static_cast<int64_t>(qtypes.size()) == 4 * layers &&
                        key_cache.size() == qkv.size() && value_cache.size() == qkv.size() &&
                        input_norm.size() == qkv.size() && post_norm.size() == qkv.size() &&
                        o_proj.size() == qkv.size() && gate_up.size() == qkv.size() &&
                        down.size() == qkv.size(),
                    "llama_layers: one entry per layer in every list (4 qtypes a layer)");
  const int64_t m = x_in.size(0), H = x_in.size(1), D = head_dim;
  const int64_t Hq = num_heads, Hk = num_kv_heads, nq = Hq * D, nkv = Hk * D;
  const int64_t ffn = intermediate_size, W = cpu::quant_panel_width();
  // every packed weight: (N / W panels, K / 32 blocks, block bytes) with N a multiple of W
  auto check_packed = [&](const at::Tensor& p, int64_t qtype, int64_t n, int64_t k,
                          const char* what, int64_t l) {
    TORCH_CHECK_VALUE(qtype >= 0 && qtype <= 2 && p.scalar_type() == at::kByte && p.dim() == 3 &&
                          p.is_contiguous() && p.size(0) * W == n && p.size(1) * 32 == k &&
                          p.size(2) == quant_packed_block_bytes(qtype, W),
                      what, "[", l, "] must be quant_pack's (", n / W, ", ", k / 32, ", ",
                      quant_packed_block_bytes(qtype, W), ") uint8 tensor, got ", p.sizes());
  };
  for (int64_t l = 0; l < layers; ++l) {
    check_packed(qkv[l], qtypes[4 * l], nq + 2 * nkv, H, "qkv", l);
    check_packed(o_proj[l], qtypes[4 * l + 1], H, nq, "o_proj", l);
    check_packed(gate_up[l], qtypes[4 * l + 2], 2 * ffn, H, "gate_up", l);
    check_packed(down[l], qtypes[4 * l + 3], H, ffn, "down", l);
    for (const at::Tensor* w : {&input_norm[l], &post_norm[l]}) {
      TORCH_CHECK_VALUE(w->numel() == H && w->scalar_type() == at::kFloat && w->is_contiguous(),
                        "input_norm / post_norm [", l, "] must be contiguous float32 (", H, ",)");
    }
  }
  TORCH_CHECK_VALUE(cos.sizes() == at::IntArrayRef({m, D}) && sin.sizes() == cos.sizes() &&
                        cos.is_contiguous() && sin.is_contiguous() &&
                        cos.scalar_type() == at::kFloat,
                    "cos and sin must be contiguous float32 (rows, head_dim)");
  // Batched decoding (seq_starts given): row r is the next token of sequence r, whose keys and
  // values are batch r of every cache; it is written at position seq_starts[r] and sees the
  // keys 0 .. seq_starts[r]. Otherwise the m rows are one sequence's, written from `start`.
  const bool batched = seq_starts.has_value();
  at::Tensor starts, kv_lens;
  int64_t end = start + m;
  if (batched) {
    TORCH_CHECK_VALUE(seq_starts->dim() == 1 && seq_starts->size(0) == m &&
                          seq_starts->scalar_type() == at::kLong && seq_starts->device().is_cpu(),
                      "seq_starts must be an int64 CPU tensor (rows,) = (", m, ",)");
    TORCH_CHECK_VALUE(!attn_mask.has_value(), "seq_starts and attn_mask exclude each other");
    starts = seq_starts->contiguous();
    const int64_t lo = starts.min().item<int64_t>(), hi = starts.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0, "seq_starts must be >= 0, got ", lo);
    end = hi + 1;
    kv_lens = starts + 1;
  }
  const int64_t cache_batch = batched ? m : 1;
  at::Tensor x = x_in.contiguous().clone();
  at::Tensor qkv_out = at::empty({m, nq + 2 * nkv}, x.options());
  at::Tensor attn = at::empty({m, nq}, x.options());
  at::Tensor proj = at::empty({m, H}, x.options());
  at::Tensor gu = at::empty({m, 2 * ffn}, x.options());
  std::vector<at::Tensor> out(1);
  auto keep = [&](int64_t index) {
    for (int64_t c : capture) {
      if (c == index) out.push_back(x.clone());
    }
  };
  keep(0);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& kc = key_cache[l];
    const at::Tensor& vc = value_cache[l];
    TORCH_CHECK_VALUE(kc.dim() == 4 && kc.size(0) == cache_batch && kc.size(1) == Hk &&
                          kc.size(3) == D && kc.size(2) >= end && kc.is_contiguous() &&
                          vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                          kc.scalar_type() == at::kFloat,
                      "key_cache / value_cache [", l, "] must be contiguous float32 (",
                      cache_batch, ", ", Hk, ", capacity >= ", end, ", ", D, ")");
    at::Tensor normed = rms_norm(x, input_norm[l], eps);
    linear(normed.data_ptr<float>(), m, H, qkv[l], qtypes[4 * l], nq + 2 * nkv,
           qkv_out.data_ptr<float>());
    float* q = qkv_out.data_ptr<float>();
    rotary(q, m, Hq, D, nq + 2 * nkv, cos.data_ptr<float>(), sin.data_ptr<float>());
    rotary(q + nq, m, Hk, D, nq + 2 * nkv, cos.data_ptr<float>(), sin.data_ptr<float>());
    float* kbuf = kc.data_ptr<float>();
    float* vbuf = vc.data_ptr<float>();
    const int64_t cap = kc.size(2);
    const int64_t* row_start = batched ? starts.data_ptr<int64_t>() : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      // (batch, position) of row r's key / value
      const int64_t b = batched ? r : 0, pos = batched ? row_start[r] : start + r;
      for (int64_t h = 0; h < Hk; ++h) {
        const int64_t at_row = ((b * Hk + h) * cap + pos) * D;
        std::memcpy(kbuf + at_row, q + r * (nq + 2 * nkv) + nq + h * D, D * sizeof(float));
        std::memcpy(vbuf + at_row, q + r * (nq + 2 * nkv) + nq + nkv + h * D, D * sizeof(float));
      }
    }
    // views of the q rows, (1, Hq, m, D) or batched (m, Hq, 1, D), and of the caches' first
    // `end` keys / values (batched: the first seq_starts[r] + 1 of batch r count, via kv_lens)
    const at::Tensor qrows = qkv_out.narrow(1, 0, nq).view({m, Hq, D});
    const at::Tensor qv = batched ? qrows.unsqueeze(2) : qrows.permute({1, 0, 2}).unsqueeze(0);
    const at::Tensor kv = kc.narrow(2, 0, end), vv = vc.narrow(2, 0, end);
    std::optional<at::Tensor> lens;
    if (batched) lens = kv_lens;
    const at::Tensor o = attention(qv, kv, vv, attn_mask, lens);
    attn.view({m, Hq, D}).copy_(batched ? o.squeeze(2) : o[0].permute({1, 0, 2}));
    linear(attn.data_ptr<float>(), m, nq, o_proj[l], qtypes[4 * l + 1], H, proj.data_ptr<float>());
    x.add_(proj);
    normed = rms_norm(x, post_norm[l], eps);
    linear(normed.data_ptr<float>(), m, H, gate_up[l], qtypes[4 * l + 2], 2 * ffn,
           gu.data_ptr<float>());
    const at::Tensor act = at::silu(gu.narrow(1, 0, ffn)) * gu.narrow(1, ffn, ffn);
    linear(act.data_ptr<float>(), m, ffn, down[l], qtypes[4 * l + 3], H, proj.data_ptr<float>());
    x.add_(proj);
    keep(l + 1);
  }
  out[0] = x;
  return out;
}

TORCH_LIBRARY_IMPL(sharpdraft_cpu_runtime, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace sharpdraft
