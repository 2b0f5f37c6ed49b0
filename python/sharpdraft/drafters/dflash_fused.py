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

from .. import settings
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


class FusedDFlashStep:
    """The arguments of `dflash_layers` for one DFlash drafter and target: the context
    projection, every layer's linears as Q8_0 blocks (q/k/v, the context's k/v and gate/up side
    by side), norms (q/k norms where the config has qk_norm), the final norm and the head
    (`fused.Head`). Build it with `FusedDFlashStep.build(drafter, target)` (None where `problems`
    names a reason); `fresh(drafter, target)` tells whether the weights it was made from are
    unchanged."""

    name = "dflash_layers"

    def __init__(self, drafter, target, head: Optional[torch.Tensor] = None):
        c = drafter.config
        self.fc = q8(drafter.fc.weight)
        self.hidden_norm = drafter.hidden_norm.weight.detach().contiguous()
        keys = ("input_norm", "post_norm", "qkv", "kv", "o_proj", "gate_up", "down")
        self.stack = {key: [] for key in keys}
        self.qk_norms = ([], [])
        for layer in drafter.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.stack["input_norm"].append(layer.input_layernorm.weight.detach().contiguous())
            self.stack["post_norm"].append(
                layer.post_attention_layernorm.weight.detach().contiguous())
            self.stack["qkv"].append(q8(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight))
            self.stack["kv"].append(q8(att.k_proj.weight, att.v_proj.weight))
            self.stack["o_proj"].append(q8(att.o_proj.weight))
            self.stack["gate_up"].append(q8(mlp.gate_proj.weight, mlp.up_proj.weight))
            self.stack["down"].append(q8(mlp.down_proj.weight))
            if c.qk_norm:
                self.qk_norms[0].append(att.q_norm.weight.detach().contiguous())
                self.qk_norms[1].append(att.k_norm.weight.detach().contiguous())
        self.qtypes = [fused.Q8_0] * (4 * len(drafter.layers))
        self.final_norm = drafter.norm.weight.detach().contiguous()
        self.head = Head(drafter, target,
                         drafter.draft_head_weight(target) if head is None else head)
        self.geometry = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.intermediate_size, float(c.rms_norm_eps))
        self.key = weights_key(drafter, target)

    @classmethod
    def build(cls, drafter, target, reuse: Optional["FusedDFlashStep"] = None
              ) -> Optional["FusedDFlashStep"]:
        """The step for `drafter` and `target`: None where `problems` names a reason, else
        `reuse` while its weights are unchanged, else a new one."""
        if not settings.get("SHARPDRAFT_FUSED_DRAFTERS"):
            return None
        if reuse is not None and reuse.fresh(drafter, target):
            return reuse
        head = drafter.draft_head_weight(target)
        return None if problems(drafter, target, head) else cls(drafter, target, head)

    def fresh(self, drafter, target) -> bool:
        return self.key == weights_key(drafter, target)

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
        floats, slopes = [], []
        for i in range(len(layers)):
            mode, slope, per_head, kw = fused.scaling(drafter.sharp, i)
            floats.append(slope)
            slopes.append(per_head)
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
