"""The PARD drafter's fused CPU step: its decoder layers, final norm and LM head in one op call
(`sharpdraft_ext.cpu_runtime.pard_layers`, csrc/cpu_runtime/pard.cpp) on Q8_0 blocks
(`drafters.fused`).

PARD drafts K tokens in one forward of K + a few rows through a few Llama layers and the LM
head. Through the PyTorch modules that forward cost about 11 ms of layers (some 4 ms of it
Python and small torch ops) and 6 ms of head against a 16 ms target step on a 2-core AVX2 EPYC
(benchmarks/results/drafter-step-cpu). The op runs the same maths in C++; the head is the
target's own quantised LM head where the drafter drafts over the target's vocabulary (PARD
borrows it), else its rows re-quantised to Q8_0.

`PARDDrafter.prepare_for_target` builds it when the engine prepares the drafter for a target
that runs on quantised blocks; `PARDDrafter.draft_logits` uses it for a call it covers
(`fused.covers`) and runs the modules otherwise. The public AMD PARD layout drafts through it
too where its layers are Llama's (no q/k norms, no biases); SHARPDRAFT_FUSED_DRAFTERS=0 turns it
off.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from sharpdraft_ext import cpu_runtime

from ..target.kv_cache import PreallocatedCache
from . import fused
from .fused import Head, weights_key


def _geometry(layer) -> tuple:
    att, cfg = layer.self_attn, layer.self_attn.config
    return (cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim,
            layer.mlp.intermediate_size, float(layer.input_layernorm.variance_epsilon))


def problems(drafter, target, head: Optional[torch.Tensor] = None) -> List[str]:
    """Why `drafter` (a PARD drafter: `layers`, `norm`, `rotary_emb`, `head`) cannot draft
    through the fused step with `target` (empty: it can); `head`: its `draft_head_weight(target)`
    when the caller has it."""
    layers = list(drafter.layers)
    out = []
    for i, layer in enumerate(layers):
        att = layer.self_attn
        if any(getattr(att, n, None) is not None for n in ("q_norm", "k_norm")):
            out.append(f"layer {i}: q/k norms in its attention (the op has none)")
        linears = [att.q_proj, att.k_proj, att.v_proj, att.o_proj, layer.mlp.gate_proj,
                   layer.mlp.up_proj, layer.mlp.down_proj]
        if any(lin.bias is not None for lin in linears):
            out.append(f"layer {i}: a linear with a bias (the op's have none)")
        if abs(att.scaling - att.head_dim ** -0.5) > 1e-12:
            out.append(f"layer {i}: softmax scale {att.scaling} (the op's is 1 / sqrt(head_dim))")
        if _geometry(layer) != _geometry(layers[0]):
            out.append(f"layer {i}: another geometry than layer 0's")
    hq, hk, d, ffn, _ = _geometry(layers[0])
    hidden = drafter.norm.weight.shape[0]
    head = drafter.draft_head_weight(target) if head is None else head
    widths = {"q/k/v": (hq + 2 * hk) * d, "o_proj": hidden, "gate/up": 2 * ffn}
    return out + fused.problems(drafter, target, head, widths,
                                {"hidden": hidden, "q heads": hq * d, "intermediate": ffn},
                                layers[0].self_attn.config.hidden_act)


class FusedPARDStep(fused.FusedStep):
    """The arguments of `pard_layers` for one PARD drafter and target: every layer's linears as
    Q8_0 blocks (q/k/v and gate/up side by side) and norms, the final norm, the head
    (`fused.Head`) and the geometry. Build it with `FusedPARDStep.build(drafter, target)` (None
    where `problems` names a reason)."""

    name = "pard_layers"
    problems = staticmethod(problems)

    def __init__(self, drafter, target, head: Optional[torch.Tensor] = None):
        self.stack = fused.pack_layers(drafter.layers)
        self.qtypes = [fused.Q8_0] * (4 * len(drafter.layers))
        self.final_norm = drafter.norm.weight.detach().contiguous()
        self.head = Head(drafter, target,
                         drafter.draft_head_weight(target) if head is None else head)
        self.geometry = _geometry(drafter.layers[0])
        self.key = weights_key(drafter, target)

    def __call__(self, drafter, embeds: torch.Tensor, positions: torch.Tensor,
                 cache: PreallocatedCache, attn_mask: Optional[torch.Tensor] = None,
                 head_from: int = 0) -> torch.Tensor:
        """`PARDDrafter.draft_logits` through the op: float32 logits (L - head_from, head rows)
        of rows head_from .. L - 1 of `embeds` (1, L, H); every row's keys and values are
        appended to `cache`."""
        layers = cache.layers[:len(self.qtypes) // 4]
        m = embeds.shape[1]
        hq, hk, d, ffn, eps = self.geometry
        start = fused.claim_rows(layers, m, embeds, hk, d)
        cos, sin = drafter.rotary_emb(embeds, positions)
        mode, floats, slopes, kw = fused.layer_scalings(drafter.sharp, len(layers))
        logits = cpu_runtime.pard_layers(
            embeds[0].contiguous(), cos[0].contiguous(), sin[0].contiguous(),
            [layer.key_buffer for layer in layers], [layer.value_buffer for layer in layers],
            start, attn_mask, *self.stack.values(), self.qtypes, hq, hk, d, ffn, eps,
            self.final_norm, self.head.packed, self.head.qtype, self.head.size, head_from,
            mode, floats, slopes, **kw)
        fused.commit_rows(layers, start + m)
        return logits
