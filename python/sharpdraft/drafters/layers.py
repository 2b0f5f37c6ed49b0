"""Pieces the drafters' attention modules share: Llama q/k/v/o projections with the head
split / merge, the keys of a context window (the last W, after the first `sinks` when the
drafter keeps attention sinks: StreamingLLM, Xiao et al. 2023, "Efficient Streaming Language
Models with Attention Sinks"), the inference mask of a windowed step, and the log-sum-exp merge
of two attention calls over disjoint keys."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class HeadProjections(nn.Module):
    """q/k/v projections from `in_features` and the output projection back to hidden_size, as
    in a Llama attention block (no biases), with the head split/merge helpers."""

    def __init__(self, config, in_features: int):
        super().__init__()
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads,
                                                            config.num_key_value_heads, d)
        self.q_proj = nn.Linear(in_features, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, L, n * d) -> (B, n, L, d)."""
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """(B, Hq, L, d) attention output -> (B, L, hidden)."""
        return self.o_proj(o.transpose(1, 2).flatten(2))


def last_keys(k: torch.Tensor, v: torch.Tensor, window: Optional[int], own: int = 0,
              attn_mask: Optional[torch.Tensor] = None, sinks: int = 0) -> tuple:
    """The first `sinks` and the last `window` context keys (plus the `own` rows of the current
    step at the end), and the matching columns of `attn_mask`; everything when window is None
    or nothing falls between them. Views without sinks, copies with them."""
    if window is None or k.shape[2] <= sinks + window + own:
        return k, v, attn_mask
    keep = window + own
    if sinks == 0:
        return (k[:, :, -keep:], v[:, :, -keep:],
                None if attn_mask is None else attn_mask[..., -keep:])
    both = lambda t: torch.cat([t[..., :sinks, :], t[..., -keep:, :]], dim=-2)   # noqa: E731
    mask = None if attn_mask is None else torch.cat([attn_mask[..., :sinks],
                                                     attn_mask[..., -keep:]], dim=-1)
    return both(k), both(v), mask


def in_window(keys: torch.Tensor, first: torch.Tensor, sinks: int = 0) -> torch.Tensor:
    """The window's rule, broadcast: key positions `keys` >= `first` (the window's first key),
    or < `sinks`. Every windowed mask (inference and training) is built from it."""
    return (keys >= first) | (keys < sinks)


def window_mask(rows: torch.Tensor, first_draft: int, window: Optional[int],
                sinks: int = 0) -> Optional[torch.Tensor]:
    """(1, 1, L, rows[-1] + 1) bool inference mask of rows at positions `rows` (increasing,
    contiguous, ending the keys): causal, and row p sees keys >= min(p, first_draft) - window
    and keys < `sinks`. None when window is None or no row would lose a key (plain
    bottom-right causal)."""
    if window is None or min(int(rows[-1]), first_draft) - window <= sinks:
        return None
    keys = torch.arange(int(rows[-1]) + 1, device=rows.device)
    start = torch.minimum(rows, torch.full_like(rows, first_draft)) - window
    seen = in_window(keys[None, :], start[:, None], sinks)
    return ((keys[None, :] <= rows[:, None]) & seen)[None, None]


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple:
    """Merge two partial attentions over disjoint key sets: (out (..., L, D), lse (..., L)) each
    -> the attention over their union, out in float32 (a running summary is kept in float32, so
    only each chunk's own output carries the rounding of its dtype). A side with lse = -inf (no
    keys) contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe).nan_to_num(0.0)[..., None]
    wb = torch.exp(lse_b - safe).nan_to_num(0.0)[..., None]
    return wa * out_a.float() + wb * out_b.float(), lse
