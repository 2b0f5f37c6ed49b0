// binding.cpp: the CUDA implementations of torch.ops.sharpdraft.sharp_attention and
// sharp_attention_varlen (schemas in csrc/attention/ops.cpp). The only translation unit of the
// CUDA extension (sharpdraft_ext._cuda) that includes torch: csrc/attention/api.h checks the
// arguments (spec §5) and fills SharpParams; this file picks the split-KV count, allocates its
// workspace and launches run_sharp_fwd (csrc/attention/cuda/sharp_fwd_launch.h) on the current
// stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "attention/api.h"
#include "attention/cuda/sharp_fwd_launch.h"
#include "common/py_module.h"

namespace sharpdraft {
namespace {

// The kernel copies q / k / v in 16-byte chunks: base pointers and every stride but the last
// must be multiples of 8 elements. Tensors that are not get an aligned contiguous copy.
bool chunk_aligned(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

at::Tensor aligned(const at::Tensor& t, Prepared& pr) {
  if (chunk_aligned(t)) return t;
  at::Tensor c = at::empty(t.sizes(), t.options());
  c.copy_(t);
  pr.keep.push_back(c);
  return c;
}

// Points params at aligned q / k / v (dense: dims b, h, row; varlen: row, h).
void align_inputs(Prepared& pr, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  bool varlen) {
  SharpParams& p = pr.params;
  const at::Tensor qa = aligned(q, pr), ka = aligned(k, pr), va = aligned(v, pr);
  p.q = qa.data_ptr();
  p.k = ka.data_ptr();
  p.v = va.data_ptr();
  const int rd = varlen ? 0 : 2;  // row dimension
  p.q_head_stride = qa.stride(1), p.q_row_stride = qa.stride(rd);
  p.k_head_stride = ka.stride(1), p.k_row_stride = ka.stride(rd);
  p.v_head_stride = va.stride(1), p.v_row_stride = va.stride(rd);
  if (!varlen) {
    p.q_batch_stride = qa.stride(0);
    p.k_batch_stride = ka.stride(0);
    p.v_batch_stride = va.stride(0);
  }
}

void check_cuda_inputs(const at::Tensor& q) {
  TORCH_CHECK_VALUE(q.is_cuda(), "sharpdraft CUDA kernel: q must be a CUDA tensor, got ",
                    q.device());
}

// Every check has passed (prepare_* allocates on q's device by itself); from here on the
// work runs on q's device and its current stream.
void launch(Prepared& pr, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            bool varlen, int64_t total_rows) {
  const c10::cuda::CUDAGuard guard(pr.out.device());
  align_inputs(pr, q, k, v, varlen);
  const SharpParams& p = pr.params;
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  cuda::SplitKV split;
  split.total_rows = total_rows;
  split.num_splits =
      cuda::sharp_fwd_num_splits(p, cuda::sharp_fwd_num_sms(stream.device_index()));
  at::Tensor o_accum, lse_accum;
  if (split.num_splits > 1) {
    const auto f32 = pr.out.options().dtype(at::kFloat);
    o_accum = at::empty({cuda::sharp_fwd_oaccum_floats(p, split.num_splits, total_rows)}, f32);
    lse_accum = at::empty({cuda::sharp_fwd_lseaccum_floats(p, split.num_splits, total_rows)}, f32);
    split.o_accum = o_accum.data_ptr<float>();
    split.lse_accum = lse_accum.data_ptr<float>();
  }
  cuda::run_sharp_fwd(p, split, stream.stream());
}

std::tuple<at::Tensor, at::Tensor> sharp_attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
    std::optional<int64_t> window, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& kv_lens, std::optional<double> scale, c10::string_view mode,
    double slope, const std::optional<at::Tensor>& slope_per_head, int64_t n_ref, int64_t topk,
    double contrast, double beta_min, double beta_max,
    const std::optional<at::Tensor>& n_visible) {
  check_cuda_inputs(q);
  Prepared pr = prepare_dense(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                              slope_per_head, n_ref, topk, contrast, beta_min, beta_max, n_visible);
  launch(pr, q, k, v, /*varlen=*/false, q.size(0) * q.size(2));
  return {pr.out, pr.lse};
}

std::tuple<at::Tensor, at::Tensor> sharp_attention_varlen_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, bool causal, std::optional<int64_t> window,
    std::optional<double> scale, c10::string_view mode, double slope,
    const std::optional<at::Tensor>& slope_per_head, int64_t n_ref, int64_t topk,
    double contrast, double beta_min, double beta_max,
    const std::optional<at::Tensor>& n_visible) {
  check_cuda_inputs(q);
  Prepared pr = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, window, scale, mode, slope, slope_per_head, n_ref, topk,
                               contrast, beta_min, beta_max, n_visible);
  launch(pr, q, k, v, /*varlen=*/true, q.size(0));
  return {pr.out, pr.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sharpdraft, CUDA, m) {
  m.impl("sharp_attention", &sharp_attention_cuda);
  m.impl("sharp_attention_varlen", &sharp_attention_varlen_cuda);
}

}  // namespace sharpdraft

SHARPDRAFT_PY_MODULE(_cuda)
