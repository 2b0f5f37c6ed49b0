"""The LongSpark drafter's inference session (`LongSparkDrafter.start`): the window read from the
target's cache, the global summary folded at each commit, parallel drafts; the protocol it
follows is `drafters.protocol`."""
from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch

from .layers import merge_lse
from .sessions import no_drafts, state_bytes, wanted

if TYPE_CHECKING:
    from .longspark import LongSparkDrafter

class LongSparkSession:
    """Chain drafting state: the boundary features and, per draft layer, the summary (M, eta)
    over the first `covered` cache rows; nothing that grows with the context."""

    def __init__(self, drafter: LongSparkDrafter, target, boundary: torch.Tensor, cache):
        self.drafter, self.target, self.cache = drafter, target, cache
        self.boundary = boundary                           # (1, n_layers * target_hidden)
        self.summary: list = [None] * drafter.config.num_layers
        self.covered = 0                                   # cache rows folded into the summary
        self.n_s = 0                                       # the count beta is taken at
        self.rebuilds = 0
        self._fold()

    def _layer_kv(self, j: int) -> tuple:
        layer = self.cache.layers[self.drafter.config.cache_layers[j]]
        return layer.keys, layer.values

    @property
    def length(self) -> int:
        return self._layer_kv(0)[0].shape[2]

    def window(self, j: int) -> tuple:
        """Views of the last W rows of draft layer j's target cache layer."""
        k, v = self._layer_kv(j)
        W = self.drafter.config.window
        return k[:, :, -W:], v[:, :, -W:]

    def _needs_rebuild(self, t: int) -> bool:
        d = self.drafter
        if d.summary_sharp().mode == "none" or self.n_s == 0:
            return False
        return any(float((d.summary_beta(j, t) - d.summary_beta(j, self.n_s)).abs().max())
                   > d.config.beta_tolerance for j in range(d.config.num_layers))

    @torch.no_grad()
    def _fold(self) -> None:
        """Fold the cache rows past `covered` into every layer's summary (or rebuild it from
        the whole cache when beta(t) has moved past the tolerance since the last rebuild)."""
        t = self.length
        if t == self.covered:
            return
        rebuild = self.covered == 0 or self._needs_rebuild(t)
        start = 0 if rebuild else self.covered
        if rebuild:
            self.n_s = t
            self.rebuilds += 1
        nv = self.n_s if self.drafter.summary_sharp().mode != "none" else None
        for j in range(self.drafter.config.num_layers):
            k, v = self._layer_kv(j)
            chunk = self.drafter.summary_chunk(j, k[:, :, start:t], v[:, :, start:t],
                                               n_visible=nv)
            self.summary[j] = chunk if rebuild else merge_lse(*self.summary[j], *chunk)
        self.covered = t

    @torch.no_grad()
    def propose(self, last: int, position: int, draw, max_drafts=None) -> tuple:
        """The round's drafts (num_drafts, the first max_drafts of them: the slots always run
        whole, they see each other); max_drafts=0 drafts nothing."""
        d, c = self.drafter, self.drafter.config
        n = wanted(c.num_drafts, max_drafts)
        if n == 0:
            return no_drafts(self.target)
        dev = self.boundary.device
        windows = [self.window(j) for j in range(c.num_layers)]
        n_visible = d.slots_n_visible(torch.tensor([position], device=dev))
        z0 = d.slot_logits(self.target, torch.tensor([last], device=dev), self.boundary,
                           torch.tensor([position], device=dev), windows, None,
                           [m for m, _ in self.summary], n_visible)[0]
        drafts, rows, prev = [], [], last
        for i in range(n):
            z = z0[i] + d.correction(torch.tensor(prev, device=dev))
            row = d.to_target_vocab(self.target, z[None])[0]
            prev = draw(row)
            drafts.append(prev)
            rows.append(row)
        return drafts, torch.stack(rows)

    def commit(self, accepted: List[int], hidden_states) -> None:
        feats = self.drafter.boundary_features(hidden_states)
        self.boundary = feats[:, len(accepted) - 1]
        self._fold()

    def state_bytes(self) -> int:
        """Bytes of the drafter's own state (summaries and boundary; the window is the
        target's cache)."""
        return state_bytes(self.boundary, self.summary)
