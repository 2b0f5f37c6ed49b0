"""Loads the compiled extension(s) and registers the fake (meta) kernels used by torch.compile."""
import importlib.util

import torch

from . import _C  # noqa: F401  (registers torch.ops.sharpdraft.* and their CPU kernels)

# The CUDA extension is optional (built only with a CUDA torch and nvcc); when it was built,
# a failure to load it is an error, not a silent fallback.
HAS_CUDA_KERNELS = importlib.util.find_spec(f"{__package__}._cuda") is not None
if HAS_CUDA_KERNELS:
    from . import _cuda  # noqa: F401  (registers the CUDA kernels)

ops = torch.ops.sharpdraft


@torch.library.register_fake("sharpdraft::sharp_attention")
def _sharp_attention_fake(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                          slope_per_head, n_ref, topk, contrast, beta_min, beta_max, n_visible):
    b, hq, lq, d = q.shape
    return q.new_empty((b, hq, lq, d)), q.new_empty((b, hq, lq), dtype=torch.float32)


@torch.library.register_fake("sharpdraft::sharp_attention_varlen")
def _sharp_attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, window, scale, mode, slope, slope_per_head, n_ref, topk,
                                 contrast, beta_min, beta_max, n_visible):
    total_q, hq, d = q.shape
    return q.new_empty((total_q, hq, d)), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.register_fake("sharpdraft::visible_counts")
def _visible_counts_fake(q, k, causal, window, attn_mask, kv_lens, n_visible):
    return q.new_empty(q.shape[:3], dtype=torch.int64)


@torch.library.register_fake("sharpdraft::query_scale")
def _query_scale_fake(n, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min, beta_max):
    return n.new_empty(n.shape, dtype=torch.float32)
