"""Pure-PyTorch reference of sharp attention (spec §1-§3).

This module never calls the compiled extension: it is the independent oracle the kernel is
tested against (spec §6). Everything here is written for clarity, not speed: it materialises
the full (B, Hq, Lq, Lk) score and mask tensors.

Two precisions:

* ``upcast=True`` (default): q, k, v are converted to float64 and every step (scores, softmax,
  P @ V, lse) runs in float64; the output *and* the lse are returned in float64. This is the
  ``ref64`` of spec §6.
* ``upcast=False``: scores, softmax and P @ V run in q's dtype T (the "PyTorch reference run in T"
  of spec §6); the output is returned in T and the lse in float32 (computed from the T scores).
  beta and ``scale`` are combined in float64 and the product is rounded to T once, then folded
  into q row-wise, as an unfused PyTorch implementation in T would do.

Public functions
----------------
``sharp_attention_ref``         dense layout, q (B, Hq, Lq, D), k/v (B, Hk, Lk, D)
``sharp_attention_varlen_ref``  packed layout, q (total_q, Hq, D), k/v (total_k, Hk, D)
``visible_mask_ref``            bool (B, Hq, Lq, Lk), the visible-key set of spec §2
``visible_counts_ref``          int64 (B, Hq, Lq), n_i of spec §2 (or the n_visible override)
``query_scale_ref``             float64 beta(n), spec §1 and §3, clamped
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .defaults import DEFAULT_CONTRAST, DEFAULT_N_REF, DEFAULT_SLOPE, DEFAULT_TOPK

__all__ = [
    "sharp_attention_ref",
    "sharp_attention_varlen_ref",
    "visible_mask_ref",
    "visible_counts_ref",
    "query_scale_ref",
]

_MODES = ("none", "fixed_slope", "exact_topk")

SlopeLike = Union[float, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# beta(n)
# ---------------------------------------------------------------------------------------------
def _check_beta_bounds(beta_min: float, beta_max: float) -> None:
    """beta = clamp(beta(n), beta_min, beta_max) is finite for every n only when beta_min is
    finite and beta_max is finite or +inf (spec §5, as the kernel checks)."""
    if not math.isfinite(beta_min):
        raise ValueError(f"beta_min must be finite, got {beta_min}")
    if math.isnan(beta_max) or beta_max == -math.inf:
        raise ValueError(f"beta_max must be finite or +inf, got {beta_max}")
    if beta_min > beta_max:
        raise ValueError(f"beta_min must be <= beta_max, got beta_min={beta_min} and "
                         f"beta_max={beta_max}")


def query_scale_ref(
    n,
    mode: str = "fixed_slope",
    slope: SlopeLike = DEFAULT_SLOPE,
    n_ref: int = DEFAULT_N_REF,
    topk: int = DEFAULT_TOPK,
    contrast: float = DEFAULT_CONTRAST,
    beta_min: float = 1.0,
    beta_max: float = float("inf"),
) -> torch.Tensor:
    """Per-row query scale beta(n) (spec §1, clamped as in §3), in float64.

    Args:
        n: visible-key counts, an int tensor (or anything ``torch.as_tensor`` accepts) of any
            shape. When ``slope`` is a per-head tensor, n's last two dims must be (..., Hq, Lq).
        mode: ``"fixed_slope"``: beta = 1 + slope * ln(n / n_ref);
            ``"exact_topk"``: beta = 1 + ln((n - topk) / (n_ref - topk)) / contrast for n > topk,
            else 1; ``"none"``: beta = 1 exactly, no clamp.
        slope: lambda, a float or a (Hq,) tensor (broadcast as ``slope[:, None]``).
        n_ref, topk, contrast: spec §1 parameters.
        beta_min, beta_max: the clamp of spec §3 (ignored for mode "none").

    Returns:
        float64 tensor of n's shape (broadcast with ``slope[:, None]`` when slope is a tensor),
        on n's device.

    Edge cases: a count n <= 0 in fixed_slope gives ln(0) = -inf before the clamp, i.e. beta =
    beta_min (such a row is empty unless n_visible overrides its count); slope == 0 gives
    exactly 1 before the clamp.

    Differentiable in a slope tensor (zero gradient where the clamp or n <= 0 holds).

    Raises:
        ValueError: unknown mode; beta_min not finite (it is the beta of n = 0 in fixed_slope,
            and +inf would make every beta infinite); beta_max NaN or -inf; beta_min > beta_max.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    _check_beta_bounds(beta_min, beta_max)
    n = torch.as_tensor(n)
    device = n.device
    n64 = n.to(torch.float64)
    if mode == "none":
        out = torch.ones_like(n64)
        if isinstance(slope, torch.Tensor):
            out = out * torch.ones_like(slope, dtype=torch.float64, device=device)[:, None]
        return out

    if mode == "fixed_slope":
        if isinstance(slope, torch.Tensor):
            lam = slope.to(device=device, dtype=torch.float64)[:, None]
        else:
            lam = torch.tensor(float(slope), dtype=torch.float64, device=device)
        # ln(n / n_ref) for n >= 1; n <= 0 (ln = -inf) is set below, after the product, so that
        # neither lam == 0 (0 * -inf) nor a slope gradient (d/dlam = ln(n / n_ref)) sees -inf.
        log_ratio = torch.log(n64.clamp_min(1.0) / float(n_ref))
        prod = lam * log_ratio
        # lam == 0 gives beta = 1 even for n <= 0. For lam < 0 and n <= 0 the product would be
        # +inf; docs/spec.md leaves n = 0 to the clamp from below (the row is empty), so treat every
        # n <= 0 as -inf.
        prod = torch.where((n64 <= 0) & (lam != 0), torch.full_like(prod, -math.inf), prod)
        beta = 1.0 + prod
    else:  # exact_topk
        if isinstance(slope, torch.Tensor):  # slope unused, but keep the broadcast shape
            n64 = n64 * torch.ones_like(slope, dtype=torch.float64, device=device)[:, None]
        num = (n64 - float(topk)).clamp_min(1.0)
        beta = torch.where(
            n64 > float(topk),
            1.0 + torch.log(num / float(n_ref - topk)) / float(contrast),
            torch.ones_like(n64),
        )
    beta = torch.where(beta < beta_min, torch.full_like(beta, float(beta_min)), beta)
    beta = torch.where(beta > beta_max, torch.full_like(beta, float(beta_max)), beta)
    return beta


# ---------------------------------------------------------------------------------------------
# Visible keys
# ---------------------------------------------------------------------------------------------
def _kv_len_tensor(kv_lens, B: int, Lk: int, device) -> torch.Tensor:
    if kv_lens is None:
        return torch.full((B,), Lk, dtype=torch.int64, device=device)
    kl = torch.as_tensor(kv_lens, device=device).to(torch.int64).reshape(-1)
    if kl.numel() != B:
        raise ValueError(f"kv_lens must have B={B} entries, got {kl.numel()}")
    return kl


def _visible_mask(B, Hq, Lq, Lk, device, causal, window, attn_mask, kv_lens) -> torch.Tensor:
    if window is not None and not causal:
        raise ValueError("window requires causal=True (spec §2)")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    kv_len = _kv_len_tensor(kv_lens, B, Lk, device)  # (B,)
    j = torch.arange(Lk, device=device).view(1, 1, Lk)
    i = torch.arange(Lq, device=device).view(1, Lq, 1)
    vis = j < kv_len.view(B, 1, 1)  # (B, 1, Lk)
    vis = vis.expand(B, Lq, Lk)
    if causal:
        pos = i + (kv_len - Lq).view(B, 1, 1)  # (B, Lq, 1): bottom-right aligned
        vis = vis & (j <= pos)
        if window is not None:
            vis = vis & (j > pos - int(window))
    vis = vis.unsqueeze(1).expand(B, Hq, Lq, Lk)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be bool, got {attn_mask.dtype}")
        vis = vis & torch.broadcast_to(attn_mask.to(device), (B, Hq, Lq, Lk))
    return vis.contiguous()


def visible_mask_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    window: Optional[int] = None,
    attn_mask: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The visible-key set of spec §2 as a bool tensor (B, Hq, Lq, Lk).

    q: (B, Hq, Lq, D), k: (B, Hk, Lk, D) (only shapes are read). Key j is visible to (b, h, i) iff
    j < kv_len_b, and (causal) j <= p_i, and (window W) j > p_i - W, and attn_mask[b, h, i, j]
    (broadcast), with p_i = i + kv_len_b - Lq (bottom-right alignment).
    """
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    return _visible_mask(B, Hq, Lq, Lk, q.device, causal, window, attn_mask, kv_lens)


def visible_counts_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    window: Optional[int] = None,
    attn_mask: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
    n_visible=None,
) -> torch.Tensor:
    """n_i of spec §2: int64 (B, Hq, Lq), the number of visible keys of every query row.

    With ``n_visible`` (int or int tensor broadcastable to (B, Hq, Lq)) the override is returned
    instead, broadcast to (B, Hq, Lq): that is the count beta is computed from.
    """
    B, Hq, Lq, _ = q.shape
    if n_visible is not None:
        nv = torch.as_tensor(n_visible, device=q.device).to(torch.int64)
        return torch.broadcast_to(nv, (B, Hq, Lq)).clone()
    return visible_mask_ref(
        q, k, causal=causal, window=window, attn_mask=attn_mask, kv_lens=kv_lens
    ).sum(dim=-1, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
def _weighted_values(p: torch.Tensor, v: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """sum over *visible* j of p_ij * v_j: (B, H, Lq, Lk) x (B, H, Lk, D) -> (B, H, Lq, D).

    A plain p @ v would let a NaN/inf in a masked key's value poison every row (0 * NaN = NaN).
    Non-finite values are rare (only NaN-propagation tests), so they take a per-key slow path
    that adds p_ij * v_j exactly where j is visible to row i.
    """
    finite = torch.isfinite(v)
    if bool(finite.all()):
        return torch.matmul(p, v)
    out = torch.matmul(p, torch.where(finite, v, torch.zeros((), dtype=v.dtype)))
    bad_keys = (~finite).any(dim=-1).flatten(0, 1).any(dim=0)  # (Lk,)
    for j in bad_keys.nonzero().flatten().tolist():
        vj = torch.where(finite[:, :, j], torch.zeros((), dtype=v.dtype), v[:, :, j])  # (B,H,D)
        term = p[..., j:j + 1] * vj.unsqueeze(2)  # (B, H, Lq, D)
        out = out + torch.where(vis[..., j:j + 1], term, torch.zeros((), dtype=v.dtype))
    return out


def sharp_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: Optional[int] = None,
    attn_mask: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    mode: str = "fixed_slope",
    slope: SlopeLike = DEFAULT_SLOPE,
    n_ref: int = DEFAULT_N_REF,
    topk: int = DEFAULT_TOPK,
    contrast: float = DEFAULT_CONTRAST,
    beta_min: float = 1.0,
    beta_max: float = float("inf"),
    n_visible=None,
    return_lse: bool = False,
    upcast: bool = True,
):
    """Reference sharp attention, dense layout (spec §2-§3).

    Args:
        q: (B, Hq, Lq, D); k, v: (B, Hk, Lk, D) with Hq % Hk == 0 (query head h reads kv head
            h // (Hq / Hk)). Any strides.
        causal, window, attn_mask, kv_lens: the visibility rules of spec §2 (bottom-right causal,
            window only with causal, bool mask broadcastable to (B, Hq, Lq, Lk), kv_lens (B,)).
        scale: softmax scale, default 1 / sqrt(D).
        mode, slope, n_ref, topk, contrast, beta_min, beta_max: beta(n) (see query_scale_ref).
        n_visible: optional int (tensor) broadcastable to (B, Hq, Lq); replaces n_i for beta only.
        return_lse: also return lse (B, Hq, Lq), natural log, -inf for empty rows.
        upcast: True -> compute and return float64 (out and lse); False -> scores, softmax and
            P @ V in q's dtype, out in q's dtype and lse in float32.

    Returns:
        out (B, Hq, Lq, D), or (out, lse). Rows with no visible key give zeros and lse = -inf.
    """
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if Hq % Hk != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hk={Hk}")
    device = q.device
    cdt = torch.float64 if upcast else q.dtype

    vis = _visible_mask(B, Hq, Lq, Lk, device, causal, window, attn_mask, kv_lens)
    n = vis.sum(dim=-1, dtype=torch.int64)  # (B, Hq, Lq)
    if n_visible is not None:
        n_beta = torch.broadcast_to(
            torch.as_tensor(n_visible, device=device).to(torch.int64), (B, Hq, Lq))
    else:
        n_beta = n
    beta = query_scale_ref(n_beta, mode=mode, slope=slope, n_ref=n_ref, topk=topk,
                           contrast=contrast, beta_min=beta_min, beta_max=beta_max)
    beta = torch.broadcast_to(beta, (B, Hq, Lq))
    sc = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    factor = (beta * sc).to(cdt)  # (B, Hq, Lq), rounded to the compute dtype once

    group = Hq // Hk
    qc = q.to(cdt)
    kc = k.to(cdt).repeat_interleave(group, dim=1)  # (B, Hq, Lk, D)
    vc = v.to(cdt).repeat_interleave(group, dim=1)

    s = torch.matmul(qc * factor.unsqueeze(-1), kc.transpose(-1, -2))  # (B, Hq, Lq, Lk) in cdt
    s = s.masked_fill(~vis, -math.inf)
    empty = (n == 0).unsqueeze(-1)  # (B, Hq, Lq, 1)
    if Lk > 0:
        p = torch.softmax(s, dim=-1)
        p = p.masked_fill(empty, 0.0)  # all -inf rows give NaN in softmax
        out = _weighted_values(p, vc, vis)
    else:
        out = torch.zeros(B, Hq, Lq, D, dtype=cdt, device=device)
    out = out.to(cdt)
    if not return_lse:
        return out
    lse_dt = torch.float64 if upcast else torch.float32
    if Lk > 0:
        lse = torch.logsumexp(s.to(lse_dt), dim=-1)
        lse = lse.masked_fill(empty.squeeze(-1), -math.inf)
    else:
        lse = torch.full((B, Hq, Lq), -math.inf, dtype=lse_dt, device=device)
    return out, lse


def sharp_attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    mode: str = "fixed_slope",
    slope: SlopeLike = DEFAULT_SLOPE,
    n_ref: int = DEFAULT_N_REF,
    topk: int = DEFAULT_TOPK,
    contrast: float = DEFAULT_CONTRAST,
    beta_min: float = 1.0,
    beta_max: float = float("inf"),
    n_visible=None,
    return_lse: bool = False,
    upcast: bool = True,
):
    """Reference sharp attention, packed (varlen) layout (spec §2-§4).

    Args:
        q: (total_q, Hq, D); k, v: (total_k, Hk, D).
        cu_seqlens_q, cu_seqlens_k: (B + 1,) cumulative sequence lengths starting at 0. Sequence
            b is q[cu_q[b]:cu_q[b+1]] against k/v[cu_k[b]:cu_k[b+1]]; its causal alignment is
            bottom-right within the sequence. Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: accepted for API parity, unused.
        n_visible: optional int (tensor) broadcastable to (total_q, Hq).
        Other keywords: as in sharp_attention_ref.

    Returns:
        out (total_q, Hq, D) (float64 when upcast, else q's dtype), or (out, lse) with lse
        (Hq, total_q) (float64 when upcast, else float32).
    """
    del max_seqlen_q, max_seqlen_k
    total_q, Hq, D = q.shape
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cu_q) != len(cu_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    cdt = torch.float64 if upcast else q.dtype
    lse_dt = torch.float64 if upcast else torch.float32
    out = torch.zeros(total_q, Hq, D, dtype=cdt, device=q.device)
    lse = torch.full((Hq, total_q), -math.inf, dtype=lse_dt, device=q.device)
    nv_all = None
    if n_visible is not None:
        nv_all = torch.broadcast_to(
            torch.as_tensor(n_visible, device=q.device).to(torch.int64), (total_q, Hq))
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 <= q0:
            continue
        qb = q[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, Hq, Lq_b, D)
        kb = k[k0:k1].transpose(0, 1).unsqueeze(0)  # (1, Hk, Lk_b, D)
        vb = v[k0:k1].transpose(0, 1).unsqueeze(0)
        nvb = None if nv_all is None else nv_all[q0:q1].transpose(0, 1).unsqueeze(0)
        ob, lb = sharp_attention_ref(
            qb, kb, vb, causal=causal, window=window, scale=scale, mode=mode, slope=slope,
            n_ref=n_ref, topk=topk, contrast=contrast, beta_min=beta_min, beta_max=beta_max,
            n_visible=nvb, return_lse=True, upcast=upcast)
        out[q0:q1] = ob[0].transpose(0, 1)
        lse[:, q0:q1] = lb[0]
    return (out, lse) if return_lse else out
