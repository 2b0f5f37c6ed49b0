"""sharpdraft_ext: fused sharp attention, the kernel of SharpDraft (docs/spec.md).

Attention whose every query row i is multiplied by beta(n_i), a fixed-slope log factor of its
cardinality n_i (the number of keys it can see), inside one fused pass:

    s_ij = beta_i * scale * <q_i, k_j>,  out_i = softmax_j(s_ij) @ v,  lse_i = logsumexp_j(s_ij)

with beta_i = clamp(1 + slope * ln(n_i / n_ref), beta_min, beta_max) ("fixed_slope", spec §1),
the exact top-k correction ("exact_topk"), or 1 ("none": plain attention, the SDPA baseline).

The target runtime's CPU ops (linear layers, the fused decoder stack) are the subpackage
`sharpdraft_ext.cpu_runtime`, an extension of their own.

Import torch before this package (the extension links torch's libraries).
"""
from typing import Optional, Union

import torch

from . import reference  # noqa: F401
from ._ops import HAS_CUDA_KERNELS, ops
from .defaults import DEFAULT_CONTRAST, DEFAULT_N_REF, DEFAULT_SLOPE, DEFAULT_TOPK

__all__ = ["sharp_attention", "sharp_attention_varlen", "visible_counts", "query_scale",
           "reference", "cpu_isa", "HAS_CUDA_KERNELS"]

_INF = float("inf")


def _split_slope(slope):
    """A float slope goes to the op as `slope`, a per-head tensor as `slope_per_head`."""
    if isinstance(slope, torch.Tensor):
        return 0.0, slope
    return float(slope), None


def _as_counts(n_visible, q: torch.Tensor):
    """n_visible may be a Python int (one cardinality for every row) or an integer tensor."""
    if n_visible is None or isinstance(n_visible, torch.Tensor):
        return n_visible
    return torch.tensor(n_visible, dtype=torch.int64, device=q.device)


def _check_device(q: torch.Tensor):
    if q.is_cuda and not HAS_CUDA_KERNELS:
        raise RuntimeError("q is a CUDA tensor but sharpdraft_ext was built without its CUDA "
                           "extension; reinstall with SHARPDRAFT_CUDA=1 and a CUDA build of torch")


def sharp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    window: Optional[int] = None, attn_mask: Optional[torch.Tensor] = None,
                    kv_lens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                    mode: str = "fixed_slope", slope: Union[float, torch.Tensor] = DEFAULT_SLOPE,
                    n_ref: int = DEFAULT_N_REF, topk: int = DEFAULT_TOPK, contrast: float = DEFAULT_CONTRAST,
                    beta_min: float = 1.0, beta_max: float = _INF,
                    n_visible: Union[int, torch.Tensor, None] = None, return_lse: bool = False):
    """Sharp attention, dense layout (spec §2-§4).

    Args:
        q: (B, Hq, Lq, D); k, v: (B, Hk, Lk, D) with Hq % Hk == 0 (GQA: query head h reads kv
            head h // (Hq // Hk)). float32, float16 or bfloat16 (CPU); float16 or bfloat16
            with D in {64, 128, 256} (CUDA). Any strides with a unit last-dimension stride.
        causal: bottom-right aligned causal mask: row i sits at key position i + kv_len - Lq.
        window: sliding window W >= 1 (needs causal): keys j > p_i - W.
        attn_mask: bool, broadcastable to (B, Hq, Lq, Lk); True = visible. n_i is counted from it.
        kv_lens: int32/int64 (B,), valid keys per batch, each in [0, Lk].
        scale: softmax scale, default 1 / sqrt(D).
        mode: "fixed_slope" (beta = 1 + slope ln(n / n_ref)), "exact_topk"
            (beta = 1 + ln((n - topk) / (n_ref - topk)) / contrast for n > topk, else 1) or
            "none" (beta = 1).
        slope: lambda, a float or a float tensor (Hq,) of per-head slopes.
        n_ref, topk, contrast: reference cardinality, k and Delta of spec §1.
        beta_min, beta_max: clamp of beta (mode "none" ignores them).
        n_visible: an int or an integer tensor broadcastable to (B, Hq, Lq): overrides n_i for
            beta only (the mask is still applied).
        return_lse: also return the log-sum-exp of the scaled scores.

    Returns:
        out (B, Hq, Lq, D) in q's dtype, and with return_lse lse (B, Hq, Lq) float32 (natural
        log). Rows with no visible key give zeros and lse = -inf.

    Differentiable in q, k, v and a slope tensor: backward returns the gradient of the float64
    reference (`reference.sharp_attention_ref`), recomputed with its (B, Hq, Lq, Lk) scores.

    Raises:
        ValueError (or RuntimeError) naming the argument for any input spec §5 rejects (beta_min
        must be finite, beta_max finite or +inf), before any work is done; on meta or fake
        tensors (torch.compile) the shape, dtype and device checks run as well.
    """
    _check_device(q)
    slope_f, slope_t = _split_slope(slope)
    out, lse = ops.sharp_attention(q, k, v, causal, window, attn_mask, kv_lens, scale, mode,
                                   slope_f, slope_t, n_ref, topk, contrast, beta_min, beta_max,
                                   _as_counts(n_visible, q))
    return (out, lse) if return_lse else out


def sharp_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                           max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                           causal: bool = False, window: Optional[int] = None,
                           scale: Optional[float] = None, mode: str = "fixed_slope",
                           slope: Union[float, torch.Tensor] = DEFAULT_SLOPE, n_ref: int = DEFAULT_N_REF,
                           topk: int = DEFAULT_TOPK, contrast: float = DEFAULT_CONTRAST, beta_min: float = 1.0,
                           beta_max: float = _INF, n_visible: Union[int, torch.Tensor, None] = None,
                           return_lse: bool = False):
    """Sharp attention over packed variable-length sequences (spec §4).

    Args:
        q: (total_q, Hq, D); k, v: (total_k, Hk, D).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,), non-decreasing from 0 to total_q / total_k;
            sequence b holds rows cu_seqlens[b] : cu_seqlens[b + 1] (may be empty).
        max_seqlen_q, max_seqlen_k: optional upper bounds of the sequence lengths.
        n_visible: an int or an integer tensor broadcastable to (total_q, Hq).
        Other keywords as in `sharp_attention` (no attn_mask or kv_lens).

    Returns:
        out (total_q, Hq, D) in q's dtype, and with return_lse lse (Hq, total_q) float32.
        Differentiable as `sharp_attention`.

    Raises:
        ValueError naming the argument for any input spec §5 rejects, before any work; the
        cu_seqlens are checked as the kernel reads them (any strides).
    """
    _check_device(q)
    slope_f, slope_t = _split_slope(slope)
    out, lse = ops.sharp_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal, window, scale, mode, slope_f,
                                          slope_t, n_ref, topk, contrast, beta_min, beta_max,
                                          _as_counts(n_visible, q))
    return (out, lse) if return_lse else out


def visible_counts(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False,
                   window: Optional[int] = None, attn_mask: Optional[torch.Tensor] = None,
                   kv_lens: Optional[torch.Tensor] = None,
                   n_visible: Union[int, torch.Tensor, None] = None) -> torch.Tensor:
    """The cardinality n_i each row's beta uses (spec §2), computed by the kernel's own code.

    Args: as `sharp_attention` (q (B, Hq, Lq, D), k (B, Hk, Lk, D); only shapes, masking
    arguments and n_visible matter). Returns int64 (B, Hq, Lq) on q's device: n_visible when
    given, else the number of keys row i sees under causal/window/kv_lens/attn_mask.
    """
    n_visible = _as_counts(n_visible, q)
    if q.is_cuda:  # counting is cheap: do it with the CPU code and move the result
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
        return visible_counts(q.cpu(), k.cpu(), causal=causal, window=window,
                              attn_mask=cpu(attn_mask), kv_lens=cpu(kv_lens),
                              n_visible=cpu(n_visible)).to(q.device)
    return ops.visible_counts(q, k, causal, window, attn_mask, kv_lens, n_visible)


def query_scale(n: torch.Tensor, *, mode: str = "fixed_slope",
                slope: Union[float, torch.Tensor] = DEFAULT_SLOPE, n_ref: int = DEFAULT_N_REF, topk: int = DEFAULT_TOPK,
                contrast: float = DEFAULT_CONTRAST, beta_min: float = 1.0,
                beta_max: float = _INF) -> torch.Tensor:
    """beta(n) elementwise, clamped to [beta_min, beta_max] (spec §1, §3), as the kernel computes it.

    Args:
        n: integer tensor of cardinalities; with a per-head slope tensor (Hq,) its shape must be
            (..., Hq, Lq).
        Other keywords as in `sharp_attention`.
    Returns: float32 tensor of n's shape, on n's device (differentiable in a slope tensor).

    Raises:
        ValueError naming the argument (as `sharp_attention`).
    """
    slope_f, slope_t = _split_slope(slope)
    beta = ops.query_scale(n.cpu(), mode, slope_f, None if slope_t is None else slope_t.cpu(),
                           n_ref, topk, contrast, beta_min, beta_max)
    return beta.to(n.device)


def cpu_isa() -> str:
    """The instruction set the CPU kernel dispatched to: "avx512", "avx2" or "base"."""
    return ops.cpu_isa()
