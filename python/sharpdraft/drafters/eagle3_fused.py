"""The EAGLE-3 drafter's fused CPU step: its decoder layer and draft head in one op call
(`sharpdraft_ext.cpu_runtime.eagle3_layer`, csrc/cpu_runtime/eagle3.cpp) on Q8_0 blocks.

A draft step through the PyTorch modules costs some 40 small ops (norms, the concatenation, seven
linears, rotary, the cache write, attention, the MLP, the head), and at batch size one their
Python and dispatch overhead outweighs the arithmetic: about 2.9 ms a drafted token at a 2k-token
context on a 2-core AVX2 EPYC, of which the linears took 0.5 ms and attention 0.4 ms
(benchmarks/results/drafter-step-cpu). The op runs the same maths in C++ on the drafter's weights
re-quantised to GGUF Q8_0 (int8 activations, as the target's own blocks run): the drafts are
those of the modules with their linears on the same blocks (`QUANT_PATH`, tested bit for bit),
and what is committed never depends on them (the target verifies every draft).

`Eagle3Drafter.prepare_for_target` builds it when the engine prepares a drafter for a target that
runs on quantised blocks; `Eagle3Drafter.draft_step` uses it for a call it covers (no autograd, a
`PreallocatedCache`, no `attention.observe` callback, float32 CPU rows; the context window
and sinks kept as the modules keep them) and runs the modules otherwise.
SHARPDRAFT_FUSED_DRAFTERS=0 turns it off (to measure against it).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from sharpdraft_ext import cpu_runtime

from ..target.kv_cache import PreallocatedCache
from . import fused
from .fused import Head, q8, weights_key


def problems(drafter, target, head: Optional[torch.Tensor] = None) -> List[str]:
    """Why `drafter` cannot draft through the fused step with `target` (empty: it can); `head`:
    its `draft_head_weight(target)` when the caller has it (`fused.problems`)."""
    c = drafter.config
    head = drafter.draft_head_weight(target) if head is None else head
    widths = {"q/k/v": (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
              "o_proj": c.hidden_size, "gate/up": 2 * c.intermediate_size}
    return fused.problems(drafter, target, head, widths,
                          {"hidden": c.hidden_size, "intermediate": c.intermediate_size},
                          c.hidden_act)


class FusedEagle3Step(fused.FusedStep):
    """The arguments of `eagle3_layer` for one drafter and target: the layer's linears and the
    draft head as Q8_0 blocks (q/k/v and gate/up side by side; the target's own quantised head
    where there is no draft vocabulary, `fused.Head`), the norms, the geometry and the
    attention's scaling. Build it with `FusedEagle3Step.build(drafter, target)` (None where
    `problems` names a reason)."""

    name = "eagle3_layer"
    windowed = True
    problems = staticmethod(problems)

    def __init__(self, drafter, target, head: Optional[torch.Tensor] = None):
        att, mlp, c = drafter.self_attn, drafter.mlp, drafter.config
        self.qkv = q8(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight)
        self.o_proj = q8(att.o_proj.weight)
        self.gate_up = q8(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.down = q8(mlp.down_proj.weight)
        self.head = Head(drafter, target,
                         drafter.draft_head_weight(target) if head is None else head)
        self.qtypes = (fused.Q8_0,) * 4 + (self.head.qtype,)   # qkv, o_proj, gate_up, down, head
        self.norms = [n.weight.detach().contiguous() for n in
                      (drafter.input_layernorm, drafter.hidden_norm,
                       drafter.post_attention_layernorm, drafter.norm)]
        self.geometry = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.intermediate_size, float(c.rms_norm_eps))
        self.feed_normed = bool(c.feed_normed_output)
        self.key = weights_key(drafter, target)

    def __call__(self, drafter, embeds: torch.Tensor, hidden: torch.Tensor,
                 positions: torch.Tensor, cache: PreallocatedCache,
                 attn_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """`Eagle3Drafter.draft_step` through the op: (logits (1, L, draft vocab) float32, the
        next rows' hidden input (1, L, H)); the rows' keys and values are appended to `cache`."""
        layers = cache.layers[:1]
        m = embeds.shape[1]
        start = fused.claim_rows(layers, m, embeds, self.geometry[1], self.geometry[2])
        cos, sin = drafter.rotary_emb(embeds, positions)
        mode, slope, slopes, kw = fused.scaling(drafter.sharp, 0)
        layer = layers[0]
        normed, x, logits = cpu_runtime.eagle3_layer(
            embeds[0].contiguous(), hidden[0].float().contiguous(), cos[0].contiguous(),
            sin[0].contiguous(), layer.key_buffer, layer.value_buffer, start, attn_mask,
            *self.norms, self.qkv, self.o_proj, self.gate_up, self.down, self.head.packed,
            self.qtypes, self.head.size, *self.geometry, mode=mode, slope=slope, slopes=slopes,
            window=drafter.context_window, sinks=drafter.attention_sinks, **kw)
        fused.commit_rows(layers, start + m)
        return logits[None], (normed if self.feed_normed else x)[None]
