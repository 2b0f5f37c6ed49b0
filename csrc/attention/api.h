// api.h: argument checks and SharpParams construction for the torch bindings (CPU and CUDA).
//
// Every check of spec §5 runs here, before anything is allocated or computed; each
// message names the offending argument. Header-only so both of the kernel's extension modules
// (sharpdraft_ext._C, sharpdraft_ext._cuda) share it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "attention/sharp_params.h"

namespace sharpdraft {

// A checked call: the params the kernels read, the outputs they write, and the tensors the
// params point into (kept alive until the kernel has run).
struct Prepared {
  SharpParams params;
  at::Tensor out, lse;
  std::vector<at::Tensor> keep;
};

namespace detail {

inline ScaleMode parse_mode(c10::string_view mode) {
  if (mode == "fixed_slope") return ScaleMode::kFixedSlope;
  if (mode == "exact_topk") return ScaleMode::kExactTopk;
  if (mode == "none") return ScaleMode::kNone;
  TORCH_CHECK_VALUE(false, "mode must be one of 'fixed_slope', 'exact_topk', 'none', got '",
                    std::string(mode), "'");
}

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// The argument checks come in two parts. The *meta* checks read only shapes, dtypes and
// devices (sizes as c10::SymInt, so they also run on the symbolic shapes of torch.compile's
// fake tensors); the check ops (csrc/attention/ops.cpp) expose them to the fake kernels
// (sharpdraft_ext/_ops.py), so a traced call is rejected exactly like an eager one. The checks
// of tensor *values* (cu_seqlens order, kv_lens range, n_visible >= 0, finite per-head slopes)
// run in prepare_* only, on the very tensors the kernel will read (converted and made
// contiguous first, then checked).

// q, k, v: dtype, device, layout and the device's support rules. Meta tensors (no device)
// get the CPU rules, the more permissive ones.
inline void check_qkv_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t rank, const char* layout) {
  const char* names[3] = {"q", "k", "v"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int t = 0; t < 3; ++t) {
    TORCH_CHECK_VALUE(ts[t]->defined(), names[t], " must be a tensor");
    TORCH_CHECK_VALUE(ts[t]->dim() == rank, names[t], " must be a ", rank, "-D tensor ", layout,
                      ", got shape ", ts[t]->sym_sizes());
  }
  const bool cuda = q.is_cuda();
  for (int t = 1; t < 3; ++t) {
    TORCH_CHECK_VALUE(ts[t]->device() == q.device(), names[t], " must be on the same device as q (",
                      q.device(), "), got ", ts[t]->device());
    TORCH_CHECK_VALUE(ts[t]->scalar_type() == q.scalar_type(), names[t],
                      " must have the same dtype as q (", q.scalar_type(), "), got ",
                      ts[t]->scalar_type());
  }
  TORCH_CHECK_VALUE(q.device().is_cpu() || cuda || q.is_meta(),
                    "q must be a CPU or CUDA tensor, got ", q.device());
  const auto dt = q.scalar_type();
  if (cuda) {
    TORCH_CHECK_VALUE(dt == at::kHalf || dt == at::kBFloat16,
                      "q: the CUDA kernel supports bfloat16 and float16, got ", dt);
  } else {
    TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                      "q: dtype must be float32, float16 or bfloat16, got ", dt);
  }
  const c10::SymInt d = q.sym_size(-1);
  TORCH_CHECK_VALUE(k.sym_size(-1) == d && v.sym_size(-1) == d, "k and v must have q's head dim ",
                    d, ", got k ", k.sym_size(-1), " and v ", v.sym_size(-1));
  if (cuda) {
    TORCH_CHECK_VALUE(d == 64 || d == 128 || d == 256,
                      "q: the CUDA kernel supports head dims 64, 128 and 256, got ", d);
  } else {
    TORCH_CHECK_VALUE(d >= 1 && d <= 256, "q: head dim must be in [1, 256], got ", d);
  }
  for (int t = 0; t < 3; ++t) {
    TORCH_CHECK_VALUE(ts[t]->sym_stride(-1) == 1 || ts[t]->sym_size(-1) == 1, names[t],
                      " must have a unit stride in its last dimension, got strides ",
                      ts[t]->sym_strides());
  }
}

inline void check_heads(const c10::SymInt& hq, const c10::SymInt& hk) {
  TORCH_CHECK_VALUE(hk >= 1 && hq % hk == 0, "q's number of heads (", hq,
                    ") must be a multiple of k's number of heads (", hk, ")");
}

inline void check_window(bool causal, std::optional<int64_t> window) {
  if (!window.has_value()) return;
  TORCH_CHECK_VALUE(causal, "window requires causal=True (a sliding window is causal)");
  TORCH_CHECK_VALUE(*window >= 1, "window must be >= 1, got ", *window);
}

// beta(n) arguments (spec §1, §5) and the per-head slope tensor's shape and dtype; fills `sp`.
inline void check_scale_args(ScaleParams& sp, std::optional<double> scale, c10::string_view mode,
                             double slope, const std::optional<at::Tensor>& slope_per_head,
                             int64_t n_ref, int64_t topk, double contrast, double beta_min,
                             double beta_max, const c10::SymInt& heads_q) {
  sp.mode = parse_mode(mode);
  TORCH_CHECK_VALUE(std::isfinite(slope), "slope must be finite, got ", slope);
  TORCH_CHECK_VALUE(n_ref >= 1, "n_ref must be >= 1, got ", n_ref);
  TORCH_CHECK_VALUE(topk >= 0, "topk must be >= 0, got ", topk);
  if (sp.mode == ScaleMode::kExactTopk) {
    TORCH_CHECK_VALUE(topk < n_ref, "topk must be smaller than n_ref in mode 'exact_topk', got topk=",
                      topk, " and n_ref=", n_ref);
  }
  TORCH_CHECK_VALUE(std::isfinite(contrast) && contrast > 0,
                    "contrast must be finite and > 0, got ", contrast);
  // beta = clamp(beta(n), beta_min, beta_max) is finite for every n only with a finite
  // beta_min (n = 0 gives beta(n) = -inf before the clamp) and beta_max finite or +inf.
  TORCH_CHECK_VALUE(std::isfinite(beta_min), "beta_min must be finite, got ", beta_min);
  TORCH_CHECK_VALUE(!std::isnan(beta_max) && beta_max != -INFINITY,
                    "beta_max must be finite or +inf, got ", beta_max);
  TORCH_CHECK_VALUE(beta_min <= beta_max, "beta_min must be <= beta_max, got beta_min=", beta_min,
                    " and beta_max=", beta_max);
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*scale), "scale must be finite, got ", *scale);
  }
  sp.slope = slope;
  sp.n_ref = n_ref;
  sp.topk = topk;
  sp.contrast = contrast;
  sp.beta_min = beta_min;
  sp.beta_max = beta_max;
  if (!slope_per_head.has_value()) return;
  const at::Tensor& s = *slope_per_head;
  TORCH_CHECK_VALUE(s.dim() == 1 && s.sym_size(0) == heads_q,
                    "slope tensor must have shape (Hq,) = (", heads_q, ",), got ", s.sym_sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(s.scalar_type()), "slope tensor must be floating point, got ",
                    s.scalar_type());
}

// The per-head slopes as the kernel reads them (float32, contiguous, on `device`), checked
// finite after the conversion (a float64 1e300 becomes inf in float32).
inline std::optional<at::Tensor> slope_tensor(const std::optional<at::Tensor>& slope_per_head,
                                              at::Device device) {
  if (!slope_per_head.has_value()) return std::nullopt;
  at::Tensor s32 = slope_per_head->to(device, at::kFloat).contiguous();
  TORCH_CHECK_VALUE(at::isfinite(s32).all().item<bool>(), "slope tensor must be finite");
  return s32;
}

// A broadcastable integer/bool side input: fails naming `name` unless `t` broadcasts to `shape`.
inline void check_broadcastable(const at::Tensor& t, c10::SymIntArrayRef shape, const char* name) {
  TORCH_CHECK_VALUE(t.dim() <= static_cast<int64_t>(shape.size()), name,
                    " must be broadcastable to ", shape, ", got shape ", t.sym_sizes());
  const int64_t off = static_cast<int64_t>(shape.size()) - t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK_VALUE(t.sym_size(d) == 1 || t.sym_size(d) == shape[off + d], name,
                      " must be broadcastable to ", shape, ", got shape ", t.sym_sizes());
  }
}

inline void check_n_visible_meta(const at::Tensor& nv, c10::SymIntArrayRef shape,
                                 at::Device device) {
  TORCH_CHECK_VALUE(nv.device() == device, "n_visible must be on q's device (", device, "), got ",
                    nv.device());
  TORCH_CHECK_VALUE(at::isIntegralType(nv.scalar_type(), /*includeBool=*/false),
                    "n_visible must be an integer tensor, got ", nv.scalar_type());
  check_broadcastable(nv, shape, "n_visible");
}

// n_visible as the kernel reads it: int64, broadcast to `shape` (strides), checked >= 0 after
// the conversion (a uint64 above 2^63 would turn negative).
inline at::Tensor n_visible_tensor(const at::Tensor& nv, at::IntArrayRef shape) {
  at::Tensor e = nv.expand(shape).to(at::kLong);
  TORCH_CHECK_VALUE(e.numel() == 0 || e.min().item<int64_t>() >= 0, "n_visible must be >= 0");
  return e;
}

// The per-head slopes (kept alive by pr) and the softmax scale, default 1 / sqrt(D).
inline void set_scaling(Prepared& pr, const std::optional<at::Tensor>& slope_per_head,
                        std::optional<double> scale, int64_t d) {
  if (slope_per_head.has_value()) {
    pr.params.sp.slope_per_head = slope_per_head->data_ptr<float>();
    pr.keep.push_back(*slope_per_head);
  }
  pr.params.softmax_scale =
      static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(d)));
}

}  // namespace detail

// Shapes, dtypes, devices and scalar arguments of a dense call (spec §2, §4, §5); see above.
inline void check_dense_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             bool causal, std::optional<int64_t> window,
                             const std::optional<at::Tensor>& attn_mask,
                             const std::optional<at::Tensor>& kv_lens,
                             std::optional<double> scale, c10::string_view mode, double slope,
                             const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                             int64_t topk, double contrast, double beta_min, double beta_max,
                             const std::optional<at::Tensor>& n_visible) {
  detail::check_qkv_common(q, k, v, 4, "(B, H, L, D)");
  const c10::SymInt B = q.sym_size(0), Hq = q.sym_size(1), Lq = q.sym_size(2);
  const c10::SymInt Hk = k.sym_size(1), Lk = k.sym_size(2);
  TORCH_CHECK_VALUE(k.sym_size(0) == B && v.sym_size(0) == B, "k and v must have q's batch size ",
                    B, ", got k ", k.sym_size(0), " and v ", v.sym_size(0));
  TORCH_CHECK_VALUE(v.sym_size(1) == Hk && v.sym_size(2) == Lk, "v must have k's shape ",
                    k.sym_sizes(), ", got ", v.sym_sizes());
  detail::check_heads(Hq, Hk);
  detail::check_window(causal, window);
  ScaleParams sp;
  detail::check_scale_args(sp, scale, mode, slope, slope_per_head, n_ref, topk, contrast,
                           beta_min, beta_max, Hq);
  if (kv_lens.has_value()) {
    const at::Tensor& kl = *kv_lens;
    TORCH_CHECK_VALUE(kl.device() == q.device(), "kv_lens must be on q's device (", q.device(),
                      "), got ", kl.device());
    TORCH_CHECK_VALUE(kl.dim() == 1 && kl.sym_size(0) == B, "kv_lens must have shape (B,) = (", B,
                      ",), got ", kl.sym_sizes());
    TORCH_CHECK_VALUE(kl.scalar_type() == at::kInt || kl.scalar_type() == at::kLong,
                      "kv_lens must be int32 or int64, got ", kl.scalar_type());
  }
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK_VALUE(m.scalar_type() == at::kBool, "attn_mask must be a bool tensor, got ",
                      m.scalar_type());
    TORCH_CHECK_VALUE(m.device() == q.device(), "attn_mask must be on q's device (", q.device(),
                      "), got ", m.device());
    detail::check_broadcastable(m, {B, Hq, Lq, Lk}, "attn_mask");
  }
  if (n_visible.has_value()) detail::check_n_visible_meta(*n_visible, {B, Hq, Lq}, q.device());
}

// Dense layout (spec §2, §4): q (B, Hq, Lq, D), k/v (B, Hk, Lk, D).
inline Prepared prepare_dense(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              bool causal, std::optional<int64_t> window,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& kv_lens,
                              std::optional<double> scale, c10::string_view mode, double slope,
                              const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                              int64_t topk, double contrast, double beta_min, double beta_max,
                              const std::optional<at::Tensor>& n_visible) {
  check_dense_meta(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                   slope_per_head, n_ref, topk, contrast, beta_min, beta_max, n_visible);
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), Lk = k.size(2);

  Prepared pr;
  SharpParams& p = pr.params;
  detail::check_scale_args(p.sp, scale, mode, slope, slope_per_head, n_ref, topk, contrast,
                           beta_min, beta_max, Hq);
  // The tensors the kernel reads, each checked after its conversion.
  const auto slope_t = detail::slope_tensor(slope_per_head, q.device());
  at::Tensor kv_lens32, mask, nv;
  if (kv_lens.has_value()) {
    // range-checked in int64 (before narrowing, which is then exact), read as int32
    const at::Tensor kl = kv_lens->to(at::kLong);
    if (B > 0) {
      const auto mn = kl.min().item<int64_t>(), mx = kl.max().item<int64_t>();
      TORCH_CHECK_VALUE(mn >= 0 && mx <= Lk, "kv_lens must lie in [0, Lk] = [0, ", Lk,
                        "], got values in [", mn, ", ", mx, "]");
    }
    kv_lens32 = kl.to(at::kInt).contiguous();
  }
  if (attn_mask.has_value()) {
    mask = attn_mask->expand({B, Hq, Lq, Lk});
    if (mask.stride(3) != 1 && Lk > 1) mask = mask.contiguous();
  }
  if (n_visible.has_value()) nv = detail::n_visible_tensor(*n_visible, {B, Hq, Lq});

  // All checks passed: allocate and describe.
  pr.out = at::empty({B, Hq, Lq, D}, q.options());
  pr.lse = at::empty({B, Hq, Lq}, q.options().dtype(at::kFloat));
  p.dtype = detail::to_dtype(q.scalar_type());
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = pr.out.data_ptr();
  p.lse = pr.lse.data_ptr<float>();
  p.batch = B; p.heads_q = Hq; p.heads_k = Hk; p.seqlen_q = Lq; p.seqlen_k = Lk; p.head_dim = D;
  p.q_batch_stride = q.stride(0); p.q_head_stride = q.stride(1); p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0); p.k_head_stride = k.stride(1); p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0); p.v_head_stride = v.stride(1); p.v_row_stride = v.stride(2);
  p.o_batch_stride = pr.out.stride(0); p.o_head_stride = pr.out.stride(1);
  p.o_row_stride = pr.out.stride(2);
  p.lse_batch_stride = Hq * Lq; p.lse_head_stride = Lq; p.lse_row_stride = 1;
  p.causal = causal;
  p.window = window.value_or(0);
  if (kv_lens32.defined()) {
    p.kv_lens = kv_lens32.data_ptr<int32_t>();
    pr.keep.push_back(kv_lens32);
  }
  if (mask.defined()) {
    p.mask = mask.data_ptr<bool>();
    p.mask_batch_stride = mask.stride(0); p.mask_head_stride = mask.stride(1);
    p.mask_row_stride = mask.stride(2);
    pr.keep.push_back(mask);
  }
  if (nv.defined()) {
    p.n_visible = nv.data_ptr<int64_t>();
    p.nv_batch_stride = nv.stride(0); p.nv_head_stride = nv.stride(1); p.nv_row_stride = nv.stride(2);
    pr.keep.push_back(nv);
  }
  detail::set_scaling(pr, slope_t, scale, D);
  return pr;
}

// Shapes, dtypes, devices and scalar arguments of a varlen call (spec §4, §5); see above.
inline void check_varlen_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                              std::optional<int64_t> max_seqlen_q,
                              std::optional<int64_t> max_seqlen_k, bool causal,
                              std::optional<int64_t> window, std::optional<double> scale,
                              c10::string_view mode, double slope,
                              const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                              int64_t topk, double contrast, double beta_min, double beta_max,
                              const std::optional<at::Tensor>& n_visible) {
  detail::check_qkv_common(q, k, v, 3, "(total, H, D)");
  const c10::SymInt Tq = q.sym_size(0), Hq = q.sym_size(1);
  const c10::SymInt Tk = k.sym_size(0), Hk = k.sym_size(1);
  TORCH_CHECK_VALUE(v.sym_size(0) == Tk && v.sym_size(1) == Hk, "v must have k's shape ",
                    k.sym_sizes(), ", got ", v.sym_sizes());
  detail::check_heads(Hq, Hk);
  detail::check_window(causal, window);
  const at::Tensor* cus[2] = {&cu_seqlens_q, &cu_seqlens_k};
  const char* cu_names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
  for (int t = 0; t < 2; ++t) {
    const at::Tensor& c = *cus[t];
    TORCH_CHECK_VALUE(c.scalar_type() == at::kInt, cu_names[t], " must be int32, got ",
                      c.scalar_type());
    TORCH_CHECK_VALUE(c.device() == q.device(), cu_names[t], " must be on q's device (",
                      q.device(), "), got ", c.device());
    TORCH_CHECK_VALUE(c.dim() == 1 && c.sym_size(0) >= 2, cu_names[t],
                      " must have shape (B + 1,) with B >= 1, got ", c.sym_sizes());
  }
  TORCH_CHECK_VALUE(cu_seqlens_k.sym_size(0) == cu_seqlens_q.sym_size(0),
                    "cu_seqlens_k must have the same length as cu_seqlens_q (",
                    cu_seqlens_q.sym_size(0), "), got ", cu_seqlens_k.sym_size(0));
  TORCH_CHECK_VALUE(max_seqlen_q.value_or(0) >= 0, "max_seqlen_q must be >= 0, got ",
                    max_seqlen_q.value_or(0));
  TORCH_CHECK_VALUE(max_seqlen_k.value_or(0) >= 0, "max_seqlen_k must be >= 0, got ",
                    max_seqlen_k.value_or(0));
  ScaleParams sp;
  detail::check_scale_args(sp, scale, mode, slope, slope_per_head, n_ref, topk, contrast,
                           beta_min, beta_max, Hq);
  if (n_visible.has_value()) detail::check_n_visible_meta(*n_visible, {Tq, Hq}, q.device());
}

// Varlen layout (spec §4): q (total_q, Hq, D), k/v (total_k, Hk, D), cu_seqlens int32 (B + 1,).
inline Prepared prepare_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               std::optional<int64_t> max_seqlen_q,
                               std::optional<int64_t> max_seqlen_k, bool causal,
                               std::optional<int64_t> window, std::optional<double> scale,
                               c10::string_view mode, double slope,
                               const std::optional<at::Tensor>& slope_per_head, int64_t n_ref,
                               int64_t topk, double contrast, double beta_min, double beta_max,
                               const std::optional<at::Tensor>& n_visible) {
  check_varlen_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    window, scale, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min,
                    beta_max, n_visible);
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hk = k.size(1);

  // cu_seqlens as the kernel reads them (contiguous int32), checked element by element: start
  // at 0, non-decreasing, end at the total.
  const at::Tensor cu[2] = {cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()};
  const char* cu_names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
  const int64_t totals[2] = {Tq, k.size(0)};
  int64_t max_len[2] = {0, 0};
  for (int t = 0; t < 2; ++t) {
    const at::Tensor h = cu[t].cpu();  // contiguous, so a[b] is element b
    const int32_t* a = h.data_ptr<int32_t>();
    const int64_t n = h.numel();
    TORCH_CHECK_VALUE(a[0] == 0, cu_names[t], " must start at 0, got ", a[0]);
    for (int64_t b = 0; b + 1 < n; ++b) {
      TORCH_CHECK_VALUE(a[b + 1] >= a[b], cu_names[t], " must be non-decreasing, got ", a[b],
                        " then ", a[b + 1], " at index ", b);
      max_len[t] = std::max<int64_t>(max_len[t], a[b + 1] - a[b]);
    }
    TORCH_CHECK_VALUE(a[n - 1] == totals[t], cu_names[t], " must end at the total length ",
                      totals[t], " of ", t == 0 ? "q" : "k", ", got ", a[n - 1]);
  }
  TORCH_CHECK_VALUE(!max_seqlen_q.has_value() || *max_seqlen_q >= max_len[0],
                    "max_seqlen_q (", max_seqlen_q.value_or(0),
                    ") is smaller than the longest sequence in cu_seqlens_q (", max_len[0], ")");
  TORCH_CHECK_VALUE(!max_seqlen_k.has_value() || *max_seqlen_k >= max_len[1],
                    "max_seqlen_k (", max_seqlen_k.value_or(0),
                    ") is smaller than the longest sequence in cu_seqlens_k (", max_len[1], ")");
  const int64_t B = cu_seqlens_q.size(0) - 1;

  Prepared pr;
  SharpParams& p = pr.params;
  detail::check_scale_args(p.sp, scale, mode, slope, slope_per_head, n_ref, topk, contrast,
                           beta_min, beta_max, Hq);
  const auto slope_t = detail::slope_tensor(slope_per_head, q.device());
  at::Tensor nv;
  if (n_visible.has_value()) nv = detail::n_visible_tensor(*n_visible, {Tq, Hq});

  pr.out = at::empty({Tq, Hq, D}, q.options());
  pr.lse = at::empty({Hq, Tq}, q.options().dtype(at::kFloat));
  pr.keep.push_back(cu[0]);
  pr.keep.push_back(cu[1]);
  p.dtype = detail::to_dtype(q.scalar_type());
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = pr.out.data_ptr();
  p.lse = pr.lse.data_ptr<float>();
  p.batch = B; p.heads_q = Hq; p.heads_k = Hk; p.head_dim = D;
  // the checked longest sequences (a larger max_seqlen_* is only a bound: sizing the grid by
  // it would launch idle tiles)
  p.seqlen_q = max_len[0];
  p.seqlen_k = max_len[1];
  p.q_head_stride = q.stride(1); p.q_row_stride = q.stride(0);
  p.k_head_stride = k.stride(1); p.k_row_stride = k.stride(0);
  p.v_head_stride = v.stride(1); p.v_row_stride = v.stride(0);
  p.o_head_stride = pr.out.stride(1); p.o_row_stride = pr.out.stride(0);
  p.lse_head_stride = Tq; p.lse_row_stride = 1;
  p.cu_seqlens_q = cu[0].data_ptr<int32_t>();
  p.cu_seqlens_k = cu[1].data_ptr<int32_t>();
  p.causal = causal;
  p.window = window.value_or(0);
  if (nv.defined()) {
    p.n_visible = nv.data_ptr<int64_t>();
    p.nv_head_stride = nv.stride(1); p.nv_row_stride = nv.stride(0);
    pr.keep.push_back(nv);
  }
  detail::set_scaling(pr, slope_t, scale, D);
  return pr;
}

// query_scale's arguments (spec §1, §5): n an integer tensor, the beta(n) arguments, and with a
// per-head slope tensor (Hq,) an n of shape (..., Hq, Lq).
inline void check_query_scale_meta(const at::Tensor& n, c10::string_view mode, double slope,
                                   const std::optional<at::Tensor>& slope_per_head,
                                   int64_t n_ref, int64_t topk, double contrast, double beta_min,
                                   double beta_max, ScaleParams* sp_out = nullptr) {
  TORCH_CHECK_VALUE(at::isIntegralType(n.scalar_type(), /*includeBool=*/false),
                    "n must be an integer tensor of cardinalities, got ", n.scalar_type());
  ScaleParams sp;
  const c10::SymInt hq = slope_per_head.has_value() ? slope_per_head->sym_numel() : c10::SymInt(1);
  detail::check_scale_args(sp, std::nullopt, mode, slope, slope_per_head, n_ref, topk, contrast,
                           beta_min, beta_max, hq);
  if (slope_per_head.has_value()) {
    TORCH_CHECK_VALUE(n.dim() >= 2 && n.sym_size(-2) == hq,
                      "n must have shape (..., Hq, Lq) with Hq = ", hq,
                      " to match the slope tensor, got ", n.sym_sizes());
  }
  if (sp_out) *sp_out = sp;
}

}  // namespace sharpdraft
