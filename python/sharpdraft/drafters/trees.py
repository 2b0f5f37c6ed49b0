"""Draft trees: `DraftTree` (what a tree-drafting session proposes and the engine verifies in
one target forward) and `expand_frontier`, one depth of EAGLE-2's dynamic tree (Li et al., 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"), which EAGLE-3 drafts
with."""
from __future__ import annotations

from typing import List

import torch


class DraftTree:
    """Draft tree: node i has token tokens[i], parent parents[i] (-1: the root, i.e. the last
    committed token) and depth depths[i] >= 1; parents precede children."""

    def __init__(self, tokens: List[int], parents: List[int], depths: List[int]):
        self.tokens, self.parents, self.depths = tokens, parents, depths

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestors(self, i: int) -> List[int]:
        """Node i and its ancestors (root excluded), root side first."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def mask(self, device=None) -> torch.Tensor:
        """(N, N) bool: row i sees node j iff j is i or an ancestor of i."""
        n = len(self)
        m = torch.zeros(n, n, dtype=torch.bool, device=device)
        for i in range(n):
            m[i, self.ancestors(i)] = True
        return m

    def children(self, i: int) -> List[int]:
        """Children of node i (-1: of the root), in proposal order."""
        return [j for j, p in enumerate(self.parents) if p == i]


def expand_frontier(scores: torch.Tensor, logp: torch.Tensor, k: int):
    """One depth of EAGLE-2's dynamic tree: the children of the F expanded nodes.

    Args:
        scores: (F,) path log-probabilities of the expanded nodes.
        logp: (F, V) each node's next-token log-probabilities.
        k: children kept per node, and nodes expanded at the next depth.

    Returns:
        (tokens (F*k,), path scores (F*k,), parent rows (F*k,), next (<= k,)): node f's k most
        likely children in rows f*k .. f*k + k - 1, best first, each scored by its parent's
        score plus its log-probability; `next` indexes the k best children overall, best
        first (ties to the earlier row), which the next depth expands.
    """
    kids = logp.topk(min(k, logp.shape[1]), dim=-1)                         # (F, k)
    score = (scores[:, None] + kids.values).flatten()
    rows = torch.arange(logp.shape[0], device=logp.device).repeat_interleave(kids.indices.shape[1])
    order = score.sort(descending=True, stable=True).indices      # ties: the earlier row
    return kids.indices.flatten(), score, rows, order[:k]
