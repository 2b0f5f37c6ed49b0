"""Data helpers the training recipes (and the evaluations that replay them) share: where a
step's anchors and windows fall on a cached sequence, which cache columns a drafter reads, and
a drafter's greedy guesses in target ids. No recipe-specific code."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def sample_anchors(trained: torch.Tensor, n: int, gen: torch.Generator,
                   max_anchor: Optional[int] = None) -> torch.Tensor:
    """Up to n distinct anchors (sorted, int64) among the rows a >= 1 with trained[a] (the first
    block row's target is a training target); trained (T,) bool. max_anchor: keep anchors
    <= max_anchor where any remain (else the earliest n), the context curriculum.

    Raises:
        ValueError: no trained row after position 0.
    """
    cand = torch.nonzero(trained[1:]).flatten() + 1
    if cand.numel() == 0:
        raise ValueError("sample_anchors: the sequence has no trained row after position 0")
    if max_anchor is not None:
        near = cand[cand <= max_anchor]
        cand = near if near.numel() else cand[:n]
    pick = torch.randperm(cand.numel(), generator=gen)[:n]
    return cand[pick].sort().values


def window_start(trained: torch.Tensor, window: int, gen: Optional[torch.Generator] = None
                 ) -> int:
    """Start of a `window`-token window (the whole sequence when shorter) that holds trained
    rows (trained (T,) bool): random (gen) or the last window (gen None)."""
    T = trained.shape[0]
    last = max(0, T - window)
    if gen is None:
        return last
    first = int(torch.nonzero(trained).flatten()[0]) if bool(trained.any()) else 0
    lo = min(max(0, first - window // 2), last)
    return lo + int(torch.randint(last - lo + 1, (), generator=gen))


def last_windows(features, window: int, least: int):
    """Yield (seq, W, off) for every sequence of `features` whose last W = min(window, T) rows
    are more than `least` and hold a trained row; off = T - W (`window_start` without a
    generator): the held-out windows of the windowed recipes' evaluations."""
    for s in range(len(features)):
        seq = features[s]
        W = min(window, seq["ids"].shape[0])
        if W > least and bool(seq["trained"][-W:].any()):
            yield seq, W, window_start(seq["trained"], W)


def fused_columns(cached_layers: Sequence[int], chosen: Sequence[int], width: int
                  ) -> torch.Tensor:
    """(len(chosen) * width,) int64 column indices of the `chosen` layers inside features cached
    for `cached_layers` (each `width` wide, concatenated in that order).

    Raises:
        ValueError: a chosen layer that the cache does not hold.
    """
    cached_layers = list(cached_layers)
    return torch.cat([torch.arange(cached_layers.index(l) * width,
                                   (cached_layers.index(l) + 1) * width) for l in chosen])


def draft_guess(drafter, logits: torch.Tensor) -> torch.Tensor:
    """The greedy guesses of `logits` (..., V_draft) as target token ids (int64; through the
    drafter's draft-to-target map `d2t` where it has a reduced draft vocabulary)."""
    guess = logits.argmax(-1)
    return guess if drafter.d2t is None else drafter.d2t[guess]


def drafter_features(drafter, seq: dict) -> torch.Tensor:
    """(T, len(target_layer_ids) * target_hidden_size) features of the target layers the drafter
    reads, taken from a cached sequence of the layers seq["layer_ids"], in the drafter's dtype
    (a bfloat16 drafter, which `--dtype auto` picks on CPUs with AVX-512 BF16, takes bfloat16
    features as its sessions do).

    Raises:
        ValueError: the cache lacks a layer the drafter reads.
    """
    cols = fused_columns(seq["layer_ids"], drafter.config.target_layer_ids,
                         drafter.config.target_hidden_size)
    return seq["feats"][:, cols].to(next(drafter.parameters()).dtype)
