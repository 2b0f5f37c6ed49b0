"""Helpers of the drafters' sessions (`protocol.DraftSession`): the bytes a session holds, its KV
cache sized for the run, cropping it back to the committed positions, and the drafts of a
parallel drafter's logits."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..target.kv_cache import PreallocatedCache


def state_bytes(*parts) -> int:
    """Bytes held by tensors, transformers caches (their layers' keys and values) and lists of
    them: what a session's `state_bytes` reports."""
    total = 0
    for x in parts:
        if isinstance(x, torch.Tensor):
            total += x.nbytes
        elif isinstance(x, (list, tuple)):
            total += state_bytes(*x)
        elif hasattr(x, "layers"):                     # a transformers Cache
            total += state_bytes(*[t for layer in x.layers
                                   for t in (getattr(layer, "keys", None),
                                             getattr(layer, "values", None)) if t is not None])
    return total


def session_cache(target_cache, num_layers: int, extra: int):
    """A drafter session's KV cache of `num_layers` layers: a `PreallocatedCache` (keys and values
    written in place) sized for the run, the target runtime cache's capacity plus `extra` rows
    that one step may append past the committed ones, when `target_cache` has a capacity; else
    a DynamicCache (which copies all of its rows on every append)."""
    capacity = getattr(target_cache, "capacity", None)
    return PreallocatedCache(num_layers, capacity + extra) if capacity else DynamicCache()


def crop_to(cache, length: int) -> None:
    """Drop the entries of a session cache (`session_cache`) past the first `length`
    positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def draw_rows(logits: torch.Tensor, draw) -> tuple:
    """Parallel drafters: draft j is drawn from row j - 1 alone; returns (drafts, logits)."""
    return [draw(row) for row in logits], logits

