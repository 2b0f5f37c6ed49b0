// sharp_params.h: the torch-free description of one sharp-attention forward call.
//
// Filled by the torch bindings (csrc/attention/api.h) or by any C++ embedder, read by the CPU
// kernel (csrc/attention/cpu/) and the CUDA kernel (csrc/attention/cuda/). Nothing here depends
// on torch or on CUDA.
// The maths it parameterises is spec §2-§3.
#pragma once

#include <cstdint>

namespace sharpdraft {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// beta(n): spec §1. kNone is plain attention (beta = 1, clamps ignored).
enum class ScaleMode : int32_t { kNone = 0, kFixedSlope = 1, kExactTopk = 2 };

struct ScaleParams {
  ScaleMode mode = ScaleMode::kFixedSlope;
  double slope = 0.2;                       // lambda, used when slope_per_head is null
  const float* slope_per_head = nullptr;    // (Hq,) per-head lambdas, same device as q
  int64_t n_ref = 2048;                     // reference cardinality
  int64_t topk = 32;                        // k of the exact top-k correction
  double contrast = 5.0;                    // Delta of the exact top-k correction
  double beta_min = 1.0;
  double beta_max = __builtin_inf();
};

// Element strides. Row-indexed arrays (q, k, v, out, lse, n_visible) are addressed as
//   dense : base + b * batch_stride + h * head_stride + i * row_stride
//   varlen: base + (cu_seqlens[b] + i) * row_stride + h * head_stride   (batch_stride unused)
struct SharpParams {
  DType dtype = DType::kFloat32;

  const void* q = nullptr;   // (B, Hq, Lq, D) dense, (total_q, Hq, D) varlen; last stride 1
  const void* k = nullptr;   // (B, Hk, Lk, D) dense, (total_k, Hk, D) varlen; last stride 1
  const void* v = nullptr;   // like k
  void* out = nullptr;       // like q, in q's dtype
  float* lse = nullptr;      // (B, Hq, Lq) dense, (Hq, total_q) varlen; natural log; may be null

  int64_t batch = 0, heads_q = 0, heads_k = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;  // dense: Lq, Lk. varlen: max_seqlen_q, max_seqlen_k
  int64_t head_dim = 0;

  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 1;

  // varlen (both set or both null): int32 (B + 1,), non-decreasing, starting at 0
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // dense only: int32 (B,), kv_lens[b] in [0, Lk]; null means Lk for every batch
  const int32_t* kv_lens = nullptr;

  bool causal = false;   // bottom-right aligned (spec §2)
  int64_t window = 0;    // > 0: sliding window (causal only); 0: none

  // dense only: bool mask broadcast to (B, Hq, Lq, Lk) via strides (0 on broadcast dims),
  // unit stride along keys. True = visible.
  const bool* mask = nullptr;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0;

  // optional n_i override for beta only (spec §2): int64, broadcast via strides
  const int64_t* n_visible = nullptr;
  int64_t nv_batch_stride = 0, nv_head_stride = 0, nv_row_stride = 0;

  float softmax_scale = 1.0f;  // scale in s_ij = beta_i * scale * <q_i, k_j>
  ScaleParams sp;

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
};

}  // namespace sharpdraft
