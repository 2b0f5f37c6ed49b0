"""Loads the attention's compiled extension(s), registers the fake (meta) kernels used by
torch.compile and the autograd formulas of the ops (torch.ops.sharpdraft; the target runtime's
ops load with `sharpdraft_ext.cpu_runtime`).

The fake kernels check their arguments with the extension's own check ops
(torch.ops.sharpdraft.check_*: the shape, dtype, device and scalar checks of
csrc/attention/api.h, which never read tensor values), so a call on fake or meta tensors is
rejected exactly where the real kernel would reject it; the checks of tensor values (cu_seqlens
order, kv_lens range, n_visible >= 0, finite per-head slopes) run when the real kernel does.

Backward (spec §4): the kernels are forward-only; the gradient of every differentiable input
(q, k, v and a per-head slope tensor) is that of the float64 reference
(`sharpdraft_ext.reference`), recomputed in backward with torch.autograd through its maths and
returned in each input's dtype.
"""
import importlib.util

import torch

from . import _C  # noqa: F401  (registers torch.ops.sharpdraft.* and their CPU kernels)
from . import reference

# The CUDA extension is optional (built only with a CUDA torch and nvcc); when it was built,
# a failure to load it is an error, not a silent fallback.
HAS_CUDA_KERNELS = importlib.util.find_spec(f"{__package__}._cuda") is not None
if HAS_CUDA_KERNELS:
    from . import _cuda  # noqa: F401  (registers the CUDA kernels)

ops = torch.ops.sharpdraft


# ----- fake (meta) kernels ------------------------------------------------------------------
@torch.library.register_fake("sharpdraft::sharp_attention")
def _sharp_attention_fake(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                          slope_per_head, n_ref, topk, contrast, beta_min, beta_max, n_visible):
    ops.check_sharp_attention(q, k, v, causal, window, attn_mask, kv_lens, scale, mode, slope,
                              slope_per_head, n_ref, topk, contrast, beta_min, beta_max,
                              n_visible)
    b, hq, lq, d = q.shape
    return q.new_empty((b, hq, lq, d)), q.new_empty((b, hq, lq), dtype=torch.float32)


@torch.library.register_fake("sharpdraft::sharp_attention_varlen")
def _sharp_attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, window, scale, mode, slope, slope_per_head, n_ref, topk,
                                 contrast, beta_min, beta_max, n_visible):
    ops.check_sharp_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, window, scale, mode, slope,
                                     slope_per_head, n_ref, topk, contrast, beta_min, beta_max,
                                     n_visible)
    total_q, hq, d = q.shape
    return q.new_empty((total_q, hq, d)), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.register_fake("sharpdraft::visible_counts")
def _visible_counts_fake(q, k, causal, window, attn_mask, kv_lens, n_visible):
    # the arguments visible_counts' CPU kernel passes to the dense checks
    ops.check_sharp_attention(q, k, k, causal, window, attn_mask, kv_lens, None, "none", 0.0,
                              None, 1, 0, 1.0, 1.0, 1.0, n_visible)
    return q.new_empty(q.shape[:3], dtype=torch.int64)


@torch.library.register_fake("sharpdraft::query_scale")
def _query_scale_fake(n, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min, beta_max):
    ops.check_query_scale(n, mode, slope, slope_per_head, n_ref, topk, contrast, beta_min,
                          beta_max)
    return n.new_empty(n.shape, dtype=torch.float32)


# ----- autograd -------------------------------------------------------------------------------
# Each op's differentiable inputs, by position in its schema, and the reference call that
# recomputes its outputs from the saved inputs.
def _dense_ref(q, k, v, slope_per_head, a):
    (causal, window, attn_mask, kv_lens, scale, mode, slope, _, n_ref, topk, contrast,
     beta_min, beta_max, n_visible) = a
    return reference.sharp_attention_ref(
        q, k, v, causal=causal, window=window, attn_mask=attn_mask, kv_lens=kv_lens, scale=scale,
        mode=mode, slope=slope if slope_per_head is None else slope_per_head, n_ref=n_ref,
        topk=topk, contrast=contrast, beta_min=beta_min, beta_max=beta_max, n_visible=n_visible,
        return_lse=True, upcast=True)


def _varlen_ref(q, k, v, slope_per_head, a):
    (cu_q, cu_k, max_q, max_k, causal, window, scale, mode, slope, _, n_ref, topk, contrast,
     beta_min, beta_max, n_visible) = a
    return reference.sharp_attention_varlen_ref(
        q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
        window=window, scale=scale, mode=mode,
        slope=slope if slope_per_head is None else slope_per_head, n_ref=n_ref, topk=topk,
        contrast=contrast, beta_min=beta_min, beta_max=beta_max, n_visible=n_visible,
        return_lse=True, upcast=True)


def _register_attention_autograd(name, ref_fn, slope_index):
    """q, k, v are inputs 0-2, the per-head slope tensor is input `slope_index`; every other
    input is not differentiable (masks, lengths, counts, floats)."""
    num_inputs = len(getattr(ops, name).default._schema.arguments)

    def setup_context(ctx, inputs, output):
        q, k, v = inputs[:3]
        slope_t = inputs[slope_index]
        ctx.save_for_backward(q, k, v, slope_t)
        ctx.others = inputs[3:]  # with the slope tensor's slot: replaced in backward

    def backward(ctx, grad_out, grad_lse):
        q, k, v, slope_t = ctx.saved_tensors
        wants = ctx.needs_input_grad
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(w)) if t is not None else None
                      for t, w in zip((q, k, v, slope_t), (wants[0], wants[1], wants[2],
                                                           wants[slope_index]))]
            out, lse = ref_fn(*leaves, ctx.others)
            pairs = [(o, g) for o, g in ((out, grad_out), (lse, grad_lse)) if g is not None]
            need = [t for t in leaves if t is not None and t.requires_grad]
            grads = torch.autograd.grad([o for o, _ in pairs],
                                        need, [g.to(o.dtype) for o, g in pairs],
                                        allow_unused=True) if need else ()
        it = iter(grads)
        got = [next(it) if t is not None and t.requires_grad else None for t in leaves]
        result = [None] * num_inputs
        result[0], result[1], result[2], result[slope_index] = got
        return tuple(result)

    torch.library.register_autograd(f"sharpdraft::{name}", backward,
                                    setup_context=setup_context)


_register_attention_autograd("sharp_attention", _dense_ref, slope_index=10)
_register_attention_autograd("sharp_attention_varlen", _varlen_ref, slope_index=12)


def _query_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[3])
    ctx.others = inputs


def _query_scale_backward(ctx, grad):
    n, slope_t = ctx.saved_tensors
    mode, slope, _, n_ref, topk, contrast, beta_min, beta_max = ctx.others[1:]
    grad_slope = None
    if slope_t is not None and ctx.needs_input_grad[3]:
        with torch.enable_grad():
            leaf = slope_t.detach().requires_grad_()
            beta = reference.query_scale_ref(n, mode=mode, slope=leaf, n_ref=n_ref, topk=topk,
                                             contrast=contrast, beta_min=beta_min,
                                             beta_max=beta_max)
            (grad_slope,) = torch.autograd.grad(beta, leaf, grad.to(beta.dtype),
                                                allow_unused=True)
    return None, None, None, grad_slope, None, None, None, None, None


torch.library.register_autograd("sharpdraft::query_scale", _query_scale_backward,
                                setup_context=_query_scale_setup)
