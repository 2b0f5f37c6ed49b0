"""One op call over a Llama-style target's decoder layers on quantised weights
(`sharpdraft_ext.cpu_runtime.llama_layers`, csrc/cpu_runtime/decoder.cpp): what `TargetRuntime`
runs for every step-sized forward (up to QUANT_MAX_ROWS rows) when the model qualifies.

A decode step of SmolLM2-135M through the Hugging Face modules spent about 30 of 52 ms in Python
and small torch ops (profiled at a 1.4k context); the op runs the same maths (RMSNorm, the fused
q/k/v and gate/up projections, rotary embedding, the KV cache write, the sharp kernel with mode
none, SiLU) in C++. The embedding, the rotary tables, the final norm and the LM head stay in the
model's own modules.

Qualifies: model_type "llama" (no attention or MLP bias, SiLU), float32, every decoder linear a
`QuantLinear`, q / k / v in one format and gate / up in one, every output width a multiple of
the packed panel width. SHARPDRAFT_FUSED_LAYERS=0 turns it off (to measure against it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from sharpdraft_ext import cpu_runtime
from torch import nn

from .. import settings
from .quantized import QuantLinear

_QTYPE_ID = {"q4_0": 0, "q4_1": 1, "q8_0": 2}


@dataclass
class FusedLayers:
    """The per-layer arguments of `llama_layers` (the modules' q/k/v and gate/up packs are
    views of `qkv` and `gate_up`)."""

    input_norm: List[torch.Tensor]
    post_norm: List[torch.Tensor]
    qkv: List[torch.Tensor]
    o_proj: List[torch.Tensor]
    gate_up: List[torch.Tensor]
    down: List[torch.Tensor]
    qtypes: List[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float


def _fuse(mods) -> Optional[torch.Tensor]:
    """One packed weight for modules that read the same input (their outputs side by side): a
    new tensor, the modules' `packed` attributes rebound to views of it (the tensors they held
    are not touched); None when formats or widths do not allow it."""
    width = cpu_runtime.quant_panel_width()
    if len({m.qtype for m in mods}) != 1 or any(m.out_features % width for m in mods):
        return None
    fused = torch.cat([m.packed for m in mods])
    start = 0
    for m in mods:
        m.packed = fused[start:start + m.packed.shape[0]]
        start += m.packed.shape[0]
    return fused


def fused_layers(model: nn.Module) -> Optional[FusedLayers]:
    """The `llama_layers` arguments of `model`, or None when it does not qualify (see the
    module docstring) or SHARPDRAFT_FUSED_LAYERS=0.

    The fused q/k/v and gate/up packs are new tensors and `model`'s q/k/v/gate/up modules are
    rebound to views of them: `TargetRuntime` calls it on its own copy of the module tree
    (`runtime.shared_copy`), whose modules are its own, so the caller's modules keep their
    packs (and the runtime holds those blocks a second time while they live)."""
    if not settings.get("SHARPDRAFT_FUSED_LAYERS"):
        return None
    cfg = model.config
    if (cfg.model_type != "llama" or getattr(cfg, "attention_bias", False)
            or getattr(cfg, "mlp_bias", False) or cfg.hidden_act != "silu"):
        return None
    decoder = model.get_decoder()
    f = FusedLayers([], [], [], [], [], [], [], cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                    cfg.intermediate_size, float(cfg.rms_norm_eps))
    for layer in decoder.layers:
        att, mlp = layer.self_attn, layer.mlp
        mods = [att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj,
                mlp.down_proj]
        if not all(isinstance(m, QuantLinear) and m.bias is None for m in mods):
            return None
        if layer.input_layernorm.weight.dtype != torch.float32:
            return None
        qkv, gate_up = _fuse(mods[:3]), _fuse(mods[4:6])
        if qkv is None or gate_up is None or any(m.out_features % cpu_runtime.quant_panel_width()
                                                 for m in mods):
            return None
        f.input_norm.append(layer.input_layernorm.weight.detach().contiguous())
        f.post_norm.append(layer.post_attention_layernorm.weight.detach().contiguous())
        f.qkv.append(qkv)
        f.o_proj.append(att.o_proj.packed)
        f.gate_up.append(gate_up)
        f.down.append(mlp.down_proj.packed)
        f.qtypes += [_QTYPE_ID[mods[0].qtype], _QTYPE_ID[mods[3].qtype],
                     _QTYPE_ID[mods[4].qtype], _QTYPE_ID[mods[6].qtype]]
    return f
