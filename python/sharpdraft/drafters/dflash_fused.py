"""The DFlash drafter's fused CPU step: the context projection, the context keys and values of
every layer, the block's layers, final norm and LM head in one op call
(`sharpdraft_ext.cpu_runtime.dflash_layers`, csrc/cpu_runtime/dflash.cpp) on Q8_0 blocks
(`drafters.fused`).

A DFlash draft runs a block of b rows (the last committed token and b - 1 mask tokens) through a
few layers whose queries see the whole context and the whole block, then the LM head. Through
the PyTorch modules each layer costs some 30 small ops besides its linears; the op runs the same
maths in C++, and the head is the target's own quantised LM head where the drafter drafts over
the target's vocabulary (it borrows it), else its rows re-quantised to Q8_0.

`DFlashDrafter.prepare_for_target` builds it when the engine prepares the drafter for a target
that runs on quantised blocks; `DFlashDrafter.draft_logits` uses it for a call it covers
(`fused.covers`) and runs the modules otherwise. SHARPDRAFT_FUSED_DRAFTERS=0 turns it off.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from sharpdraft_ext import cpu_runtime

from ..target.kv_cache import PreallocatedCache
from . import fused
from .fused import Head, q8, weights_key


def problems(drafter, target, head: Optional[torch.Tensor] = None) -> List[str]:
    """Why `drafter` (a `DFlashDrafter`) cannot draft through the fused step with `target`
    (empty: it can); `head`: its `draft_head_weight(target)` when the caller has it."""
    c = drafter.config
    head = drafter.draft_head_weight(target) if head is None else head
    widths = {"q/k/v": (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
              "k/v": 2 * c.num_key_value_heads * c.head_dim, "o_proj": c.hidden_size,
              "gate/up": 2 * c.intermediate_size, "fc": c.hidden_size}
    inputs = {"hidden": c.hidden_size, "q heads": c.num_attention_heads * c.head_dim,
              "intermediate": c.intermediate_size, "context features": drafter.fc.in_features}
    return fused.problems(drafter, target, head, widths, inputs, c.hidden_act)


class FusedDFlashStep(fused.FusedStep):
    """The arguments of `dflash_layers` for one DFlash drafter and target: the context
    projection, every layer's linears as Q8_0 blocks (q/k/v, the context's k/v and gate/up side
    by side), norms (q/k norms where the config has qk_norm), the final norm and the head
    (`fused.Head`). Build it with `FusedDFlashStep.build(drafter, target)` (None where `problems`
    names a reason)."""

    name = "dflash_layers"
    problems = staticmethod(problems)

    def __init__(self, drafter, target, head: Optional[torch.Tensor] = None):
        c = drafter.config
        self.fc = q8(drafter.fc.weight)
        self.hidden_norm = drafter.hidden_norm.weight.detach().contiguous()
        self.stack = fused.pack_layers(drafter.layers, context_kv=True)
        self.qk_norms = ([layer.self_attn.q_norm.weight.detach().contiguous()
                          for layer in drafter.layers],
                         [layer.self_attn.k_norm.weight.detach().contiguous()
                          for layer in drafter.layers]) if c.qk_norm else ([], [])
        self.qtypes = [fused.Q8_0] * (4 * len(drafter.layers))
        self.final_norm = drafter.norm.weight.detach().contiguous()
        self.head = Head(drafter, target,
                         drafter.draft_head_weight(target) if head is None else head)
        self.geometry = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.intermediate_size, float(c.rms_norm_eps))
        self.key = weights_key(drafter, target)

    @staticmethod
    def covers(drafter, block: torch.Tensor, context: torch.Tensor, cache) -> bool:
        """Whether a step with these block rows and new context rows runs fused
        (`fused.covers` for both)."""
        return fused.covers(drafter, block, cache) and fused.covers(drafter, context, cache)

    def __call__(self, drafter, block: torch.Tensor, positions: torch.Tensor,
                 context: torch.Tensor, context_positions: torch.Tensor,
                 cache: PreallocatedCache, head_from: int = 1) -> torch.Tensor:
        """`DFlashDrafter.forward` and its head through the op: float32 logits (b - head_from,
        head rows) of block rows head_from .. b - 1, for the block embeddings `block` (1, b, H)
        at `positions` (1, b) after the new context features `context` (1, Tn, F) at
        `context_positions` (1, Tn); the context's keys and values are appended to `cache` (the
        block's are written past them and dropped)."""
        layers = cache.layers[:len(self.qtypes) // 4]
        b, tn = block.shape[1], context.shape[1]
        hq, hk, d, ffn, eps = self.geometry
        start = fused.claim_rows(layers, tn + b, block, hk, d)
        cos, sin = drafter.rotary_emb(block, positions)
        ctx_cos, ctx_sin = drafter.rotary_emb(block, context_positions)
        mode, floats, slopes, kw = fused.layer_scalings(drafter.sharp, len(layers))
        logits = cpu_runtime.dflash_layers(
            block[0].contiguous(), cos[0].contiguous(), sin[0].contiguous(),
            context[0].float().contiguous(), ctx_cos[0].contiguous(), ctx_sin[0].contiguous(),
            self.fc, fused.Q8_0, self.hidden_norm,
            [layer.key_buffer for layer in layers], [layer.value_buffer for layer in layers],
            start, *self.stack.values(), self.qtypes, *self.qk_norms, hq, hk, d, ffn, eps,
            self.final_norm, self.head.packed, self.head.qtype, self.head.size, head_from,
            mode, floats, slopes, **kw)
        fused.commit_rows(layers, start + tn)
        return logits
