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


def wanted(most: int, max_drafts) -> int:
    """How many drafts a propose makes: the session's `most`, or fewer when the engine's
    max_drafts (None: no limit) asks for fewer (`protocol.DraftSession.propose`)."""
    return most if max_drafts is None else max(0, min(most, int(max_drafts)))


def no_drafts(target) -> tuple:
    """A propose's answer when it drafts nothing (max_drafts=0, a target-only step): ([],
    float32 logits (0, target vocab))."""
    w = target.get_output_embeddings().weight
    return [], torch.zeros((0, w.shape[0]), dtype=torch.float32, device=w.device)


def draw_rows(logits: torch.Tensor, draw) -> tuple:
    """Parallel drafters: draft j is drawn from row j - 1 alone; returns (drafts, logits)."""
    return [draw(row) for row in logits], logits

