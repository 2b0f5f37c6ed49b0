"""Choosing the next token from logits: greedy (temperature 0), or a draw from the softmax at a
temperature, optionally restricted to the top-p nucleus. The one sampler of the package: the
speculative engine (`engine`) and the batched generator (`batched`) both use it.
"""
from __future__ import annotations

from typing import Optional

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) over the last dimension, in float32.

    Args:
        logits: (..., V) any float dtype.
        temperature: > 0.

    Returns:
        (..., V) float32 probabilities.
    """
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None, *,
                candidates: int = 64) -> torch.Tensor:
    """Next token ids from last-position logits.

    temperature 0: the argmax. Otherwise a draw from `probabilities(logits, temperature)`; with
    top_p < 1 the draw is restricted to the smallest set of most likely tokens whose probability
    reaches `top_p` (the nucleus; the most likely token always stays). The nucleus is searched
    among the `candidates` most likely tokens first; when some row's nucleus is larger, every
    row takes the full sort, so the distribution is exactly the nucleus one.

    Args:
        logits: (V,) or (B, V).
        temperature: >= 0.
        top_p: in (0, 1]; 1 keeps the whole vocabulary.
        generator: the torch.Generator the draw uses (on the logits' device; None: torch's
            default generator). Unused at temperature 0.

    Returns:
        int64 token ids of shape logits.shape[:-1] (a 0-d tensor for (V,) logits).

    Raises:
        ValueError: negative temperature, or top_p outside (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(-1)
    probs = probabilities(logits, temperature)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    kept, order = probs.topk(min(candidates, probs.shape[-1]), dim=-1)
    if not bool((kept.sum(-1) >= top_p).all()):
        kept, order = probs.sort(dim=-1, descending=True)
    kept = kept.masked_fill(kept.cumsum(-1) - kept >= top_p, 0.0)
    pick = torch.multinomial(kept, 1, generator=generator)
    return order.gather(-1, pick).squeeze(-1)
