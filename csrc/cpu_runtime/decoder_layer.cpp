// decoder_layer.cpp: the decoder layer shared by the fused ops (decoder_layer.h). Its attention
// is the attention library's op (sharpdraft::sharp_attention, sharpdraft_ext._C), called
// through the dispatcher: the kernel is not compiled into this extension.
#include "cpu_runtime/decoder_layer.h"

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>

#include "cpu_runtime/api.h"
#include "cpu_runtime/quant_linear.h"

namespace sharpdraft {
namespace decoder {
namespace {

void parallel_panels(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, 1, body);
}

// sharpdraft::sharp_attention's CPU kernel: bottom-right causal without a mask, else the mask;
// kv_lens limits each batch's keys. Returns out. Called below autograd: the op's autograd
// formula is Python (sharpdraft_ext/_ops.py) and would take the GIL once a layer, for outputs
// nothing differentiates.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const Rows& rows, const Scaling& s) {
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
  const bool causal = rows.causal && !rows.attn_mask.has_value();
  return std::get<0>(op.call(q, k, v, causal, std::nullopt, rows.attn_mask, rows.kv_lens,
                             std::nullopt, s.mode, s.slope, s.slopes, s.n_ref, s.topk,
                             s.contrast, s.beta_min, s.beta_max, std::nullopt));
}

// attention over the first rows.sinks and the last rows.window + m of the `end` keys k, v
// (1, Hk, end, D): views without sinks, copies with them (the modules' last_keys), the mask's
// key columns (where it has `end` of them) cut alike.
at::Tensor windowed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const Rows& rows, int64_t m, const Scaling& s) {
  const int64_t keep = rows.window + m, from = rows.end - keep, S = rows.sinks;
  const auto cut = [&](const at::Tensor& t, int64_t dim) {
    return S == 0 ? t.narrow(dim, from, keep)
                  : at::cat({t.narrow(dim, 0, S), t.narrow(dim, from, keep)}, dim);
  };
  Rows kept = rows;
  if (rows.attn_mask.has_value() && rows.attn_mask->size(-1) == rows.end) {
    kept.attn_mask = cut(*rows.attn_mask, rows.attn_mask->dim() - 1);
  }
  return attention(q, cut(k, 2), cut(v, 2), kept, s);
}

}  // namespace

Workspace::Workspace(int64_t m, int64_t hidden, const Geometry& g,
                     const at::TensorOptions& options)
    : qkv_out(at::empty({m, (g.num_heads + 2 * g.num_kv_heads) * g.head_dim}, options)),
      attn(at::empty({m, g.num_heads * g.head_dim}, options)),
      proj(at::empty({m, hidden}, options)),
      gate_up(at::empty({m, 2 * g.intermediate_size}, options)) {}

// RMSNorm and SiLU(gate) * up through the same ATen ops as transformers' LlamaRMSNorm and
// LlamaMLP, so that each value is the same bits as in the modules: an int8 activation on a
// rounding boundary would otherwise move by a whole step in one path only.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

void linear(const float* x, int64_t m, int64_t k, const at::Tensor& packed, int64_t qtype,
            int64_t n, float* y) {
  cpu::quant_linear(static_cast<cpu::QuantType>(qtype), x, m, k, packed.data_ptr<uint8_t>(), n, k,
                    nullptr, y, n, parallel_panels);
}

void check_packed(const at::Tensor& p, int64_t qtype, int64_t n, int64_t k, const char* what,
                  int64_t layer) {
  const int64_t W = cpu::quant_panel_width();
  TORCH_CHECK_VALUE(qtype >= 0 && qtype <= 2 && p.scalar_type() == at::kByte && p.dim() == 3 &&
                        p.is_contiguous() && p.size(0) * W == n && p.size(1) * 32 == k &&
                        p.size(2) == quant_packed_block_bytes(qtype, W),
                    what, "[", layer, "] must be quant_pack's (", n / W, ", ", k / 32, ", ",
                    quant_packed_block_bytes(qtype, W), ") uint8 tensor, got ", p.sizes());
}

void check_cache(const at::Tensor& kc, const at::Tensor& vc, int64_t batch, const Geometry& g,
                 int64_t end, int64_t layer) {
  TORCH_CHECK_VALUE(kc.dim() == 4 && kc.size(0) == batch && kc.size(1) == g.num_kv_heads &&
                        kc.size(3) == g.head_dim && kc.size(2) >= end && kc.is_contiguous() &&
                        vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                        (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kHalf ||
                         kc.scalar_type() == at::kBFloat16) &&
                        vc.scalar_type() == kc.scalar_type(),
                    "key_cache / value_cache [", layer, "] must be contiguous float32, float16 or "
                    "bfloat16, both the same (", batch, ", ", g.num_kv_heads, ", capacity >= ", end,
                    ", ", g.head_dim, ")");
}

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

void head_rms_norm(float* x, int64_t m, int64_t heads, int64_t head_dim, int64_t row_stride,
                   const at::Tensor& w, double eps) {
  const at::Tensor view =
      at::from_blob(x, {m, heads, head_dim}, {row_stride, head_dim, 1}, at::kFloat);
  view.copy_(rms_norm(view.contiguous(), w, eps));
}

void check_stack(const Stack& s, const Geometry& g, int64_t H, const char* op) {
  const size_t n = s.qkv.size();
  TORCH_CHECK_VALUE(s.qtypes.size() == 4 * n && s.o_proj.size() == n && s.gate_up.size() == n &&
                        s.down.size() == n && s.input_norm.size() == n && s.post_norm.size() == n,
                    op, ": one entry per layer in every list (4 qtypes a layer)");
  const int64_t nq = g.num_heads * g.head_dim, nkv = g.num_kv_heads * g.head_dim;
  const int64_t ffn = g.intermediate_size;
  for (int64_t l = 0; l < s.size(); ++l) {
    check_packed(s.qkv[l], s.qtypes[4 * l], nq + 2 * nkv, H, "qkv", l);
    check_packed(s.o_proj[l], s.qtypes[4 * l + 1], H, nq, "o_proj", l);
    check_packed(s.gate_up[l], s.qtypes[4 * l + 2], 2 * ffn, H, "gate_up", l);
    check_packed(s.down[l], s.qtypes[4 * l + 3], H, ffn, "down", l);
    for (const at::Tensor* w : {&s.input_norm[l], &s.post_norm[l]}) {
      TORCH_CHECK_VALUE(w->numel() == H && w->scalar_type() == at::kFloat && w->is_contiguous(),
                        "input_norm / post_norm [", l, "] must be contiguous float32 (", H, ",)");
    }
  }
}

Scaling layer_scaling(c10::string_view mode, at::ArrayRef<double> slope,
                      const c10::List<std::optional<at::Tensor>>& slopes, int64_t l,
                      int64_t n_ref, int64_t topk, double contrast, double beta_min,
                      double beta_max) {
  Scaling s;
  s.mode = std::string(mode);
  s.slope = slope[l];
  s.slopes = slopes.get(l);
  s.n_ref = n_ref;
  s.topk = topk;
  s.contrast = contrast;
  s.beta_min = beta_min;
  s.beta_max = beta_max;
  return s;
}

at::Tensor head_logits(const at::Tensor& x, int64_t head_from, const at::Tensor& final_norm,
                       const at::Tensor& head, int64_t head_qtype, int64_t head_size,
                       double eps) {
  const int64_t m = x.size(0), H = x.size(1);
  check_packed(head, head_qtype, head_size, H, "head", 0);
  TORCH_CHECK_VALUE(final_norm.numel() == H && final_norm.scalar_type() == at::kFloat &&
                        final_norm.is_contiguous(),
                    "final_norm must be contiguous float32 (", H, ",)");
  TORCH_CHECK_VALUE(head_from >= 0 && head_from <= m, "head_from must lie in [0, ", m, "], got ",
                    head_from);
  const int64_t n = m - head_from;
  at::Tensor logits = at::empty({n, head_size}, x.options());
  if (n > 0) {
    const at::Tensor normed = rms_norm(x.narrow(0, head_from, n), final_norm, eps);
    linear(normed.data_ptr<float>(), n, H, head, head_qtype, head_size, logits.data_ptr<float>());
  }
  return logits;
}

void check_rotary(const at::Tensor& cos, const at::Tensor& sin, int64_t m, int64_t head_dim) {
  TORCH_CHECK_VALUE(cos.sizes() == at::IntArrayRef({m, head_dim}) && sin.sizes() == cos.sizes() &&
                        cos.is_contiguous() && sin.is_contiguous() &&
                        cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                    "cos and sin must be contiguous float32 (rows, head_dim)");
}

namespace {

// D values from float32 into a cache row of T (float: copied; float16 / bfloat16: rounded to
// nearest even, as torch's .to() rounds them)
template <typename T>
void store_row(T* dst, const float* src, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, D * sizeof(float));
  } else {
    for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

template <typename T>
void write_rows(const float* k, const float* v, int64_t m, int64_t row_stride, const Geometry& g,
                const at::Tensor& key_cache, const at::Tensor& value_cache, const Rows& rows) {
  const int64_t Hk = g.num_kv_heads, D = g.head_dim, cap = key_cache.size(2);
  T* kbuf = key_cache.data_ptr<T>();
  T* vbuf = value_cache.data_ptr<T>();
  const bool batched = rows.seq_starts != nullptr;
  for (int64_t r = 0; r < m; ++r) {
    // (batch, position) of row r's key / value
    const int64_t b = batched ? r : 0, pos = batched ? rows.seq_starts[r] : rows.start + r;
    for (int64_t h = 0; h < Hk; ++h) {
      const int64_t at_row = ((b * Hk + h) * cap + pos) * D;
      store_row(kbuf + at_row, k + r * row_stride + h * D, D);
      store_row(vbuf + at_row, v + r * row_stride + h * D, D);
    }
  }
}

}  // namespace

void write_cache(const float* k, const float* v, int64_t m, int64_t row_stride, const Geometry& g,
                 const at::Tensor& key_cache, const at::Tensor& value_cache, const Rows& rows) {
  switch (key_cache.scalar_type()) {
    case at::kHalf:
      return write_rows<at::Half>(k, v, m, row_stride, g, key_cache, value_cache, rows);
    case at::kBFloat16:
      return write_rows<at::BFloat16>(k, v, m, row_stride, g, key_cache, value_cache, rows);
    default:
      return write_rows<float>(k, v, m, row_stride, g, key_cache, value_cache, rows);
  }
}

void run_layer(at::Tensor& x, const at::Tensor& normed, const LayerWeights& w, const Geometry& g,
               const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const Rows& rows, const Scaling& scaling,
               Workspace& ws) {
  const int64_t m = x.size(0), H = x.size(1), D = g.head_dim;
  const int64_t Hq = g.num_heads, Hk = g.num_kv_heads, nq = Hq * D, nkv = Hk * D;
  const int64_t ffn = g.intermediate_size, width = nq + 2 * nkv;
  linear(normed.data_ptr<float>(), m, normed.size(1), w.qkv, w.qtype_qkv, width,
         ws.qkv_out.data_ptr<float>());
  float* q = ws.qkv_out.data_ptr<float>();
  if (w.q_norm != nullptr) head_rms_norm(q, m, Hq, D, width, *w.q_norm, g.eps);
  if (w.k_norm != nullptr) head_rms_norm(q + nq, m, Hk, D, width, *w.k_norm, g.eps);
  rotary(q, m, Hq, D, width, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotary(q + nq, m, Hk, D, width, cos.data_ptr<float>(), sin.data_ptr<float>());
  write_cache(q + nq, q + nq + nkv, m, width, g, key_cache, value_cache, rows);
  const bool batched = rows.seq_starts != nullptr;
  // views of the q rows, (1, Hq, m, D) or batched (m, Hq, 1, D), and of the caches' first
  // `end` keys / values (batched: the first seq_starts[r] + 1 of batch r count, via kv_lens)
  const at::Tensor qrows = ws.qkv_out.narrow(1, 0, nq).view({m, Hq, D});
  // a 16-bit cache: the queries in its dtype too (the kernel takes one dtype), as llama.cpp
  // converts them for its float16 cache; the output comes back to float32 in the copy below
  const at::Tensor q32 = batched ? qrows.unsqueeze(2) : qrows.permute({1, 0, 2}).unsqueeze(0);
  const at::ScalarType kv_type = key_cache.scalar_type();
  const at::Tensor qv = kv_type == at::kFloat ? q32 : q32.to(kv_type);
  const at::Tensor kv = key_cache.narrow(2, 0, rows.end), vv = value_cache.narrow(2, 0, rows.end);
  const at::Tensor o = rows.window >= 0 && !batched && rows.end > rows.sinks + rows.window + m
                           ? windowed_attention(qv, kv, vv, rows, m, scaling)
                           : attention(qv, kv, vv, rows, scaling);
  ws.attn.view({m, Hq, D}).copy_(batched ? o.squeeze(2) : o[0].permute({1, 0, 2}));
  linear(ws.attn.data_ptr<float>(), m, nq, w.o_proj, w.qtype_o, H, ws.proj.data_ptr<float>());
  x.add_(ws.proj);
  const at::Tensor post = rms_norm(x, w.post_norm, g.eps);
  linear(post.data_ptr<float>(), m, H, w.gate_up, w.qtype_gate_up, 2 * ffn,
         ws.gate_up.data_ptr<float>());
  const at::Tensor act = at::silu(ws.gate_up.narrow(1, 0, ffn)) * ws.gate_up.narrow(1, ffn, ffn);
  linear(act.data_ptr<float>(), m, ffn, w.down, w.qtype_down, H, ws.proj.data_ptr<float>());
  x.add_(ws.proj);
}

}  // namespace decoder
}  // namespace sharpdraft
