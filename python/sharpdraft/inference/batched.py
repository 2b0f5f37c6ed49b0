"""Batched target-only decoding: many prompts answered at once, one forward per step for the
whole batch (the corpus generator's loop; no drafter, no speculation).

Two paths, the same contract:
- A target the runtime runs in one `llama_layers` call (`sharpdraft.target.fused`: a Llama on
  its GGUF's quantised blocks): no padding. Each prompt is prefilled alone by a
  `TargetRuntime` into its own row of batch-sized caches, then every step is one call over one
  row per live sequence, each row at its own position and seeing only its own keys
  (`seq_starts`). Every row is computed alone, so a greedy response is token for token the
  runtime's target-only decoding of that prompt.
- Any other causal LM: the Hugging Face modules of the runtime's prepared copy (sharp
  attention, prepacked linears) over left-padded prompts (masked out).

Either way the model runs through a `TargetRuntime` (`engine.runtime_session`): the caller's
model is left as it is.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from sharpdraft_ext import cpu_runtime

from ..target.kv_cache import CACHE_KWARG, PreallocatedCache
from ..target.plan import KV_DTYPES
from ..target.quantized import QUANT_MAX_ROWS
from ..target.runtime import TargetRuntime
from .engine import gc_paused, runtime_session
from .sampling import sample_next

COMPACT_AT = 0.75     # drop the finished rows once at most this fraction of the batch is live


def _left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int, max_new_tokens: int):
    """(ids (B, W) int64, attention mask (B, W + max_new_tokens) int64) of left-padded prompts:
    the mask is 1 on each prompt's tokens, 0 on its padding and on the positions to come."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width + max_new_tokens), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):width] = 1
    return ids, mask


def _append(out: List[List[int]], finished: List[bool], live: List[int], tokens: List[int],
            eos_token_id: Optional[int]) -> List[int]:
    """Append each batch row's new token to its prompt's response (rows already finished
    take none), mark the rows that reached EOS, and return the rows still running."""
    keep = []
    for r, (i, tok) in enumerate(zip(live, tokens)):
        if not finished[i]:
            out[i].append(tok)
            finished[i] = tok == eos_token_id
        if not finished[i]:
            keep.append(r)
    return keep


@gc_paused
@torch.no_grad()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   pad_token_id: int, eos_token_id: Optional[int], temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> List[List[int]]:
    """The model's responses to a batch of prompts: one forward per step for the whole batch,
    and rows that reached EOS dropped from the batch once a quarter of it has finished. A
    target that `sharpdraft.target.fused` runs in one call (on CPU) takes the unpadded path of
    the module docstring; any other, prompts left-padded with `pad_token_id` (masked out;
    position ids count real tokens only) with keys and values in a
    `sharpdraft.target.PreallocatedCache` sized for the whole batch.

    Args:
        model: a transformers causal LM (left as it is: it runs through a runtime of its own,
            prepared with the "auto" plan and kept for its later calls; see
            `engine.runtime_session`) or a `sharpdraft.target.TargetRuntime`; either way the
            forwards are the runtime's prepared copy's.
        prompts: B token-id lists (lengths may differ, each >= 1).
        max_new_tokens: at most this many tokens per prompt (>= 1).
        pad_token_id: fills the left padding (never attended to).
        eos_token_id: a row stops after this token (None: every row runs to max_new_tokens).
        temperature, top_p: 0 for greedy; else sampling at this temperature with nucleus
            `top_p` (`sampling.sample_next`), from a torch.Generator seeded with `seed`.

    Returns:
        B lists of generated ids, each cut after its first `eos_token_id` (kept) or at
        `max_new_tokens`.

    Raises:
        ValueError: no prompts, an empty prompt, or max_new_tokens < 1.
        RuntimeError: a `TargetRuntime` that another generation is using.
    """
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("prompts: need at least one prompt, each with at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    with runtime_session(model, max(len(p) for p in prompts)) as runtime:
        device = next(runtime.model.parameters()).device
        generator = (torch.Generator(device=device).manual_seed(seed) if temperature > 0
                     else None)
        if device.type == "cpu" and runtime.fused is not None:
            return _unpadded(runtime, prompts, max_new_tokens, eos_token_id, temperature, top_p,
                             generator)
        return _padded(runtime.model, prompts, max_new_tokens, pad_token_id, eos_token_id,
                       temperature, top_p, generator)


def _padded(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int,
            eos_token_id: Optional[int], temperature: float, top_p: float,
            generator: Optional[torch.Generator]) -> List[List[int]]:
    """`generate_batch` through the Hugging Face modules of `model` (a runtime's prepared copy)
    over left-padded prompts, keys and values in one batch-sized `PreallocatedCache`."""
    device = next(model.parameters()).device
    ids, mask = _left_padded(prompts, pad_token_id, max_new_tokens)
    ids, mask = ids.to(device), mask.to(device)
    width = ids.shape[1]
    cache = PreallocatedCache(model.config.num_hidden_layers, width + max_new_tokens)
    out: List[List[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))       # the prompt index of each batch row
    finished = [False] * len(prompts)      # by prompt index
    step_ids, seen = ids, width            # this forward's input ids; positions after it
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    for t in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=mask[:, :seen], position_ids=pos,
                       **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        nxt = sample_next(logits, temperature, top_p, generator)
        keep = _append(out, finished, live, nxt.tolist(), eos_token_id)
        if not keep or t == max_new_tokens - 1:
            break
        if len(keep) <= COMPACT_AT * len(live):      # compact: drop the finished rows
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            mask, nxt, pos = mask.index_select(0, rows), nxt.index_select(0, rows), pos[rows]
            live = [live[r] for r in keep]
        mask[:, seen] = 1
        seen += 1
        step_ids, pos = nxt[:, None], pos[:, -1:] + 1
    return out


def _unpadded(runtime: TargetRuntime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              eos_token_id: Optional[int], temperature: float, top_p: float,
              generator: Optional[torch.Generator]) -> List[List[int]]:
    """`generate_batch` on a target with fused layers: each prompt prefilled alone into its
    row of (B, kv heads, capacity, head dim) caches, then one `llama_layers` call a step with
    one row per live sequence at its own position (`seq_starts`)."""
    model, f = runtime.model, runtime.fused
    decoder = model.get_decoder()
    capacity = max(len(p) for p in prompts) + max_new_tokens
    shape = (len(prompts), f.num_kv_heads, capacity, f.head_dim)
    kv = KV_DTYPES.get(runtime.plan.kv_dtype, torch.float32)           # the runtime's cache dtype
    keys = [torch.empty(shape, dtype=kv) for _ in range(runtime.num_layers)]   # rows past a
    values = [torch.empty(shape, dtype=kv) for _ in range(runtime.num_layers)]  # length: unread
    rows = []
    for b, p in enumerate(prompts):           # prefill: each prompt alone, no padding
        runtime.start(len(p))
        rows.append(runtime.forward(torch.tensor([list(p)]), last_only=True).logits[-1])
        for layer, k, v in zip(runtime.cache.layers, keys, values):
            k[b, :, :len(p)] = layer.key_buffer[0, :, :len(p)]
            v[b, :, :len(p)] = layer.value_buffer[0, :, :len(p)]
    runtime.cache = None
    logits = torch.stack(rows)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    out: List[List[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))       # the prompt index of each batch row
    finished = [False] * len(prompts)      # by prompt index
    head = model.get_output_embeddings()
    for t in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, generator)
        keep = _append(out, finished, live, nxt.tolist(), eos_token_id)
        if not keep or t == max_new_tokens - 1:
            break
        if len(keep) <= COMPACT_AT * len(live):      # compact: drop the finished rows
            index = torch.tensor(keep)
            keys = [k.index_select(0, index) for k in keys]
            values = [v.index_select(0, index) for v in values]
            nxt, lengths = nxt[index], lengths[index]
            live = [live[r] for r in keep]
        x = decoder.embed_tokens(nxt[:, None])                      # (B, 1, hidden)
        cos, sin = decoder.rotary_emb(x, lengths[:, None])          # (B, 1, head dim)
        hidden = cpu_runtime.llama_layers(
            x[:, 0], cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous(), keys,
            values, 0, None, f.input_norm, f.post_norm, f.qkv, f.o_proj, f.gate_up, f.down,
            f.qtypes, f.num_heads, f.num_kv_heads, f.head_dim, f.intermediate_size, f.eps, [],
            lengths)[0]
        # the LM head in slices a decode step's kernel takes (QUANT_MAX_ROWS rows at most)
        logits = torch.cat([head(decoder.norm(h)).float()
                            for h in hidden.split(QUANT_MAX_ROWS)])
        lengths = lengths + 1
    return out
