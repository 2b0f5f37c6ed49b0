"""Distillation losses and the draft vocabulary, shared by every recipe.

Every drafter is trained against the target's next-token distribution kept in the feature cache
as its top-k probabilities (`training.cache`), renormalised over the ids inside the drafter's
draft vocabulary (soft cross-entropy = KL to that distribution up to its entropy).
"""
from __future__ import annotations

from typing import Optional

import torch


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(b - 1,) loss weights of block rows 1 .. b - 1: exp(-(j - 1) / gamma) (DFlash)."""
    j = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(j - 1) / gamma)


def soft_cross_entropy(logits: torch.Tensor, top_p: torch.Tensor,
                       top_i: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of drafter logits (..., V) against the target's top-k distribution
    (top_p, top_i (..., k); ids in the drafter's vocabulary, -1 = outside it, dropped before
    renormalising); returns (...)."""
    logq = torch.log_softmax(logits, dim=-1)
    top_i = top_i.long()
    p = top_p.float() * (top_i >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    return -(p * logq.gather(-1, top_i.clamp_min(0))).sum(-1)


def l1_distance(logits: torch.Tensor, top_p: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
    """Total-variation-style L1 distance ||q - p||_1 between the drafter's distribution
    q = softmax(logits) (..., V) and the target's top-k distribution renormalised over the ids
    inside the draft vocabulary (top_p, top_i (..., k), -1 = outside), p taken as 0 elsewhere:
    sum over the top-k of |q_j - p_j| plus the drafter's mass outside them; returns (...), in
    [0, 2] (LongSpark's distribution term)."""
    q = torch.softmax(logits.float(), dim=-1)
    top_i = top_i.long()
    inside = top_i >= 0
    p = top_p.float() * inside
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    q_top = q.gather(-1, top_i.clamp_min(0)) * inside
    return (q_top - p).abs().sum(-1) + (1.0 - q_top.sum(-1)).clamp_min(0.0)


def distill_loss(logits: torch.Tensor, top_p: torch.Tensor, top_i: torch.Tensor,
                 weights: torch.Tensor, valid: Optional[torch.Tensor] = None):
    """Position-weighted soft cross-entropy against the target's renormalised top-k distribution.

    Args:
        logits: (K, b - 1, V) drafter logits of block rows 1 .. b - 1 over its draft vocabulary.
        top_p, top_i: (K, b - 1, k) the target's top-k probabilities and their ids in the draft
            vocabulary (-1: outside it; such entries are dropped before renormalising).
        weights: (b - 1,) per-row weights.
        valid: (K, b - 1) bool, the rows that are training targets (None: all).

    Returns:
        (loss: the weighted mean over valid rows, per-row mean cross-entropy (b - 1,) over the
        valid rows of each block position).
    """
    ce = soft_cross_entropy(logits, top_p, top_i)                      # (K, b - 1)
    v = torch.ones_like(ce) if valid is None else valid.to(ce.dtype)
    per_row = (ce * v).sum(0) / v.sum(0).clamp_min(1.0)
    w = v * weights.to(ce.dtype)
    return (ce * w).sum() / w.sum().clamp_min(1e-12), per_row.detach()


def agreement_metrics(losses, oks, valids) -> dict:
    """Held-out metrics of the parallel drafters' evaluations: losses, one per sequence; oks /
    valids, per sequence, (K, n) bool: draft j of round k equals the target's top-1 / is a
    training target. Returns loss (mean), top1_per_position (n,), top1_mean and tau_proxy =
    1 + E[number of leading agreeing drafts] (an invalid row ends the run)."""
    agree = torch.stack([ok.float().sum(0) for ok in oks]).sum(0)
    counted = torch.stack([v.float().sum(0) for v in valids]).sum(0)
    per_pos = agree / counted.clamp_min(1.0)
    lead = torch.cat([ok.int().cumprod(-1).sum(-1).float() for ok in oks])
    return {"loss": sum(losses) / len(losses),
            "top1_per_position": [round(float(x), 4) for x in per_pos],
            "top1_mean": float(per_pos.mean()), "tau_proxy": 1.0 + float(lead.mean())}


def copy_losses(ce: torch.Tensor, copy: torch.Tensor, num_copies: int) -> torch.Tensor:
    """(C,) mean of the per-row losses `ce` (R,) of each copy (`copy` (R,) int64); NaN where a
    copy has no rows (PARD)."""
    total = torch.zeros(num_copies, dtype=ce.dtype, device=ce.device).index_add(0, copy, ce)
    count = torch.zeros(num_copies, dtype=ce.dtype, device=ce.device).index_add(
        0, copy, torch.ones_like(ce))
    return total / count


def trained_ahead(trained: torch.Tensor, span: int) -> torch.Tensor:
    """(T,) bool: row p has a trained row among p .. p + span - 1 (rows past the end count as
    untrained). The rows a multi-token loss needs: a draft whose own target or a later draft's
    target in its chain is trained."""
    out = trained.clone()
    for i in range(1, span):
        out[:-i] |= trained[i:]
    return out


def decoding_walk(runs: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The steps greedy speculative decoding takes over teacher-forced text.

    A step starting at row t commits runs[t] + 1 tokens (its leading agreeing drafts and the
    target's own token), so the next step starts at row t + runs[t] + 1; a row where `start` is
    False (no trained target: a prompt) is skipped to the next row where it holds, as a new
    response starts a new walk. The mean of the result is the acceptance length tau that real
    decoding of this text would measure; the mean of runs + 1 over every row (tau_proxy) is
    usually larger, since a step tends to start just after a rejected draft (README, "An
    AVX2-only CPU": EAGLE-3 2.43 against 2.18 on the held-out set).

    Args:
        runs: (n,) int, leading agreeing drafts of a step starting at each row.
        start: (n,) bool, rows where a step may start.

    Returns:
        (steps,) float32, tokens committed by each step of the walk.
    """
    runs, start = runs.tolist(), start.tolist()
    steps, t = [], 0
    while t < len(runs):
        if not start[t]:
            t += 1
            continue
        steps.append(runs[t] + 1)
        t += int(runs[t]) + 1
    return torch.tensor(steps, dtype=torch.float32)


def draft_vocabulary(features, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids the drafter may propose, sorted: the most frequent in the cached
    sequences (a `FeatureSet`, or any iterable of dicts with "ids", "top_i", "top_p"), counting
    each position's token, the target's top-1 token there, and its top-k probability mass (which
    ranks tokens that are never a top-1).

    Raises:
        ValueError: size outside [2, vocab_size].
    """
    if not 2 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must lie in [2, {vocab_size}], got {size}")
    shards = features.shards() if hasattr(features, "shards") else features
    counts = torch.zeros(vocab_size, dtype=torch.float64, device="cpu")
    for sh in shards:
        sh = {k: v.cpu() for k, v in sh.items()}
        top_i = sh["top_i"].long()
        counts += (torch.bincount(sh["ids"].flatten().long(), minlength=vocab_size).double()
                   + torch.bincount(top_i[..., 0].flatten(), minlength=vocab_size)
                   + torch.bincount(top_i.flatten(), weights=sh["top_p"].flatten().double(),
                                    minlength=vocab_size))
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def target_to_draft(d2t: Optional[torch.Tensor], vocab_size: int) -> Optional[torch.Tensor]:
    """(vocab_size,) map target id -> draft id, -1 outside the draft vocabulary (None: identity)."""
    if d2t is None:
        return None
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    return t2d


def feature_scale(rows: torch.Tensor) -> torch.Tensor:
    """(F*H,) per-dimension 1 / RMS of context feature rows (N, F*H) (position 0 left out by
    `FeatureSet.feature_rows`).

    A few target dimensions carry massive activations (SmolLM2: dim 507 of layer 19 is ~10^2
    everywhere and ~2*10^4 at position 0, against a median of ~4); through a random projection
    and RMSNorm they make every context vector nearly the same and the drafter collapses to a
    unigram guess. Recipes feed features * scale to the drafter and fold the scale into its first
    projection (DFlash) or store it in the checkpoint (EAGLE-3), so inference reads raw features.
    """
    return rows.float().pow(2).mean(0).sqrt().clamp_min(1e-3).reciprocal()
