"""z-lab DFlash drafters in their public checkpoint layout, run with sharp attention.

The public DFlash drafters (z-lab/dflash `dflash/model.py`, `DFlashDraftModel`; served natively by
vLLM's `qwen3_dflash.py` and SGLang) differ from the project's own DFlash drafter
(`drafters.dflash`): q/k RMSNorms per head (Qwen3 style), no draft vocabulary (logits over the
whole target vocabulary through the target's LM head), optional sliding-window layers, and a
Hugging Face style config.json. This module reads such a folder as it is published:

    config.json   architectures ["DFlashDraftModel"], model_type "qwen3", block_size (top level,
                  or in dflash_config), num_target_layers, dflash_config {mask_token_id,
                  target_layer_ids}, the Qwen3 geometry fields
    weights       model.safetensors, or shards listed by model.safetensors.index.json, or a
                  pytorch_model.bin (read with torch.load(weights_only=True)); the tensors
                  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm
                  .weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
                  layers.{i}.{input,post_attention}_layernorm.weight, fc.weight
                  [H, n_features * H], hidden_norm.weight, norm.weight (no embedding and no LM
                  head: the target's are borrowed)

A draft step embeds the block [last committed token, mask x (b - 1)] with the target's
embedding; the context is hidden_norm(fc(concat of the target layers' outputs)) at the committed
positions; every layer's keys / values are [k_proj / v_proj of the context ; of the block], k_norm
on both, q_norm on the queries, RoPE at absolute positions; full-attention layers are
non-causal over context + block (n_i = context + b for every row), sliding-window layers causal
with their window (n_i counted by the kernel from that mask); the logits are the target's LM head
over norm(block output) at block positions 1 .. b - 1. The context keys / values are cached per
layer and extended when a verification commits tokens; the block's own are discarded every
step. Attention runs through `sharpdraft_ext.sharp_attention` (`attention.attend`): the
drafter's `sharp` SharpConfig with mode "none" is the published drafter, "fixed_slope" SharpDraft
(n_ref: `config.train_context`, a training length when the config records one, else 2048).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from ..attention import SharpConfig, attend
from .base import (CONFIG_FILE, DEFAULT_TRAIN_CONTEXT, ConfigKindError, Drafter,
                   check_draft_threshold, draw_rows, feature_layer_problems, state_bytes)
from .public_files import (DRAFT_THRESHOLD_KEY, check_tensors, is_int, read_draft_threshold,
                           read_public_config, read_weights, save_folder, weight_index,
                           weights_dtype)

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
FULL, SLIDING = "full_attention", "sliding_attention"

# config.json keys the config reads (the rest is kept in `extra` and written back by `save`).
_READ_KEYS = {"architectures", "block_size", "num_target_layers", "dflash_config", "hidden_size",
              "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "vocab_size", "rms_norm_eps", "hidden_act", "attention_bias",
              "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
              "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
              "tie_word_embeddings", "target_hidden_size", "is_causal", "is_neox_style",
              "mask_token_id", "train_context", "sharp_slopes", DRAFT_THRESHOLD_KEY}
_DFLASH_READ_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "causal", "use_swa",
                     "swa_window_size", "attention_sink_bias", "train_context"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The target layers a public DFlash drafter reads when its config names none (the reference
    code's fallback): one per draft layer, evenly spaced from 1 to L - 3 (the middle layer for a
    one-layer drafter). Id l is the output of decoder layer l (hidden_states[l + 1])."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class ZLabDFlashConfig:
    """A public DFlash drafter's config.json, resolved (see `from_public`; `to_public` writes it).

    hidden_size .. head_dim, intermediate_size, rms_norm_eps, hidden_act, attention_bias,
    max_position_embeddings, rope_parameters: the Qwen3 geometry of the draft layers.
    num_hidden_layers: draft layers. num_target_layers: decoder layers of the target it was
    trained for. target_layer_ids: target layers whose outputs form the context (layer l =
    hidden_states[l + 1]). block_size: b (1 anchor + b - 1 drafts). mask_token_id: the target
    token filling the draft slots. layer_types: "full_attention" / "sliding_attention" per draft
    layer; sliding_window: W of the sliding layers. causal: None (full layers non-causal, sliding
    ones causal) or a bool forcing every layer (dflash_config.causal / is_causal).
    target_hidden_size: width of each target feature (default hidden_size). train_context_length:
    the context length the drafter was trained on when the config records one (`train_context`,
    top level or in dflash_config). sharp_slopes: calibrated SharpDraft slopes (top level, as
    `sharpdraft analyze calibrate` writes them). draft_threshold: chain drafting's measured
    default (top level; 0 when absent: every draft verified). block_size_in_dflash_config: where
    block_size is
    written back. extra / dflash_extra: the other fields of config.json / dflash_config, kept.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: List[int]
    block_size: int = 16
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                           "rope_theta": 1000000.0})
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    causal: Optional[bool] = None
    target_hidden_size: Optional[int] = None
    tie_word_embeddings: bool = False
    train_context_length: Optional[int] = None
    sharp_slopes: Optional[list] = None
    draft_threshold: float = 0.0
    block_size_in_dflash_config: bool = False
    extra: dict = field(default_factory=dict)
    dflash_extra: dict = field(default_factory=dict)

    def __post_init__(self):
        name = type(self).__name__
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers if is_int(
                self.num_hidden_layers) else None
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        for f, lo in (("hidden_size", 1), ("intermediate_size", 1), ("num_attention_heads", 1),
                      ("num_key_value_heads", 1), ("head_dim", 1), ("num_hidden_layers", 1), ("num_target_layers", 1), ("block_size", 2),
                      ("mask_token_id", 0), ("vocab_size", 1), ("target_hidden_size", 1),
                      ("max_position_embeddings", 1)):
            v = getattr(self, f)
            if not is_int(v) or v < lo:
                raise ValueError(f"{name}.{f} must be an integer >= {lo}, got {v!r}")
        check_draft_threshold(self.draft_threshold, f"{name}.draft_threshold")
        if self.num_attention_heads % self.num_key_value_heads:
            # (hidden_size need not be heads * head_dim: Qwen3 layers give head_dim apart)
            raise ValueError(f"{name}: num_attention_heads {self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads {self.num_key_value_heads} "
                             f"(grouped-query attention)")
        ids = self.target_layer_ids
        if (not isinstance(ids, list) or not ids
                or not all(is_int(i) and i >= 0 for i in ids)):
            raise ValueError(f"{name}.target_layer_ids must be a non-empty list of layer ids "
                             f">= 0, got {ids!r}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"{name}.mask_token_id {self.mask_token_id} is outside "
                             f"vocab_size {self.vocab_size}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"{name}.rms_norm_eps must be a number > 0, got "
                             f"{self.rms_norm_eps!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"{name}.hidden_act {self.hidden_act!r} is not an activation "
                             f"transformers knows")
        if not isinstance(self.rope_parameters, dict) or "rope_theta" not in self.rope_parameters:
            raise ValueError(f"{name}.rope_parameters must be an object with rope_theta, got "
                             f"{self.rope_parameters!r}")
        if (not isinstance(self.layer_types, list)
                or len(self.layer_types) != self.num_hidden_layers
                or any(t not in (FULL, SLIDING) for t in self.layer_types)):
            raise ValueError(f"{name}.layer_types must list {self.num_hidden_layers} of "
                             f"{FULL!r} / {SLIDING!r}, got {self.layer_types!r}")
        if SLIDING in self.layer_types:
            if not is_int(self.sliding_window) or self.sliding_window < 1:
                raise ValueError(f"{name}.sliding_window must be an integer >= 1 for its "
                                 f"sliding_attention layers, got {self.sliding_window!r}")
            if self.causal is False:
                raise ValueError(f"{name}.causal false with sliding_attention layers: "
                                 f"non-causal sliding windows are not supported")
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ValueError(f"{name}.causal must be null, true or false, got {self.causal!r}")
        if self.train_context_length is not None and (
                not is_int(self.train_context_length) or self.train_context_length < 1):
            raise ValueError(f"{name}.train_context_length must be null or an integer >= 1, "
                             f"got {self.train_context_length!r}")

    # ----- what the rest of the project reads ---------------------------------------------
    @property
    def train_context(self) -> int:
        """SharpDraft's default n_ref: the recorded training length, else 2048."""
        return self.train_context_length or DEFAULT_TRAIN_CONTEXT

    @property
    def records_train_context(self) -> bool:
        """Whether config.json records the training length (else n_ref defaults to 2048)."""
        return self.train_context_length is not None

    @property
    def draft_vocab_size(self) -> None:
        """Public DFlash drafters draft over the whole target vocabulary."""
        return None

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def layer_attention(self, layer: int) -> tuple:
        """(causal, window) of draft layer `layer`: full layers non-causal, sliding layers
        causal with window sliding_window, unless `causal` forces every layer."""
        window = self.sliding_window if self.layer_types[layer] == SLIDING else None
        causal = self.causal if self.causal is not None else window is not None
        return causal, window

    def qwen3_config(self) -> Qwen3Config:
        """The transformers Qwen3Config the MLP and RoPE modules are built from."""
        return Qwen3Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           num_hidden_layers=self.num_hidden_layers,
                           rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters),
                           vocab_size=self.vocab_size)

    # ----- config.json ----------------------------------------------------------------------
    @classmethod
    def from_public(cls, raw: dict, where: str = CONFIG_FILE) -> "ZLabDFlashConfig":
        """Parse a public config.json (a dict). Missing target_layer_ids: `build_target_layer_ids`
        (num_target_layers, num_hidden_layers); missing Qwen3 fields take Qwen3Config's defaults,
        as the reference code's Qwen3Config does (rope_scaling / rope_theta or rope_parameters;
        layer_types from use_sliding_window / max_window_layers).

        Raises:
            ConfigKindError: not a DFlashDraftModel config (architectures).
            ValueError naming `where` and the field: a missing or mistyped field, an invalid
                value, or a variant not supported (attention sink bias, interleaved RoPE).
        """
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must hold a JSON object")
        archs = raw.get("architectures")
        if not isinstance(archs, list) or ARCHITECTURE not in archs:
            raise ConfigKindError(f"{where} is not a public DFlash config (architectures "
                                  f"{archs!r}, expected [{ARCHITECTURE!r}])")
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"{where}: dflash_config must be an object, got {dflash!r}")

        def need_int(key, source, label):
            if key not in source:
                raise ValueError(f"{where}: missing {label}")
            v = source[key]
            if not is_int(v):
                raise ValueError(f"{where}: {label} must be an integer, got {json.dumps(v)}")
            return v

        for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                    "num_hidden_layers"):
            need_int(key, raw, key)
        num_layers = raw["num_hidden_layers"]
        in_dflash = "block_size" in dflash
        block = need_int("block_size", dflash if in_dflash else raw,
                         "dflash_config.block_size" if in_dflash else "block_size")
        if "mask_token_id" in dflash:
            mask = need_int("mask_token_id", dflash, "dflash_config.mask_token_id")
        elif "mask_token_id" in raw:
            mask = need_int("mask_token_id", raw, "mask_token_id")
        else:
            raise ValueError(f"{where}: missing dflash_config.mask_token_id")
        if "target_layer_ids" in dflash:
            ids = dflash["target_layer_ids"]
            if not isinstance(ids, list) or not all(is_int(i) for i in ids):
                raise ValueError(f"{where}: dflash_config.target_layer_ids must be a list of "
                                 f"integers, got {json.dumps(ids)}")
            num_target = raw.get("num_target_layers", max(ids, default=0) + 1)
            if not is_int(num_target):
                raise ValueError(f"{where}: num_target_layers must be an integer, got "
                                 f"{json.dumps(num_target)}")
        else:
            num_target = need_int("num_target_layers", raw, "num_target_layers")
            if num_target < 4 and num_layers > 1:
                raise ValueError(f"{where}: num_target_layers {num_target} is too few to place "
                                 f"{num_layers} target_layer_ids (give "
                                 f"dflash_config.target_layer_ids)")
            ids = build_target_layer_ids(num_target, num_layers)
        if dflash.get("attention_sink_bias") or raw.get("add_swa_attention_sink_bias"):
            raise ValueError(f"{where}: dflash_config.attention_sink_bias is not supported")
        if raw.get("is_neox_style", True) is not True:
            raise ValueError(f"{where}: is_neox_style false (interleaved RoPE) is not supported")
        for key in ("num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                    "sliding_window", "max_window_layers", "target_hidden_size"):
            if raw.get(key) is not None and not is_int(raw[key]):
                raise ValueError(f"{where}: {key} must be an integer, got {json.dumps(raw[key])}")
        for key in ("rms_norm_eps", "rope_theta"):
            if key in raw and (isinstance(raw[key], bool)
                               or not isinstance(raw[key], (int, float))):
                raise ValueError(f"{where}: {key} must be a number, got {json.dumps(raw[key])}")
        for key in ("rope_scaling", "rope_parameters"):
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise ValueError(f"{where}: {key} must be an object or null, got "
                                 f"{json.dumps(raw[key])}")
        qwen_keys = ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
                     "rms_norm_eps", "hidden_act", "attention_bias", "max_position_embeddings",
                     "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
                     "use_sliding_window", "max_window_layers")
        try:   # what the reference code's Qwen3Config makes of these fields
            q = Qwen3Config(**{k: raw[k] for k in qwen_keys if k in raw})
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{where}: not a valid Qwen3 geometry ({first})") from None
        layer_types = list(raw["layer_types"]) if isinstance(raw.get("layer_types"), list) \
            else list(q.layer_types)
        window = dflash.get("swa_window_size", raw.get("sliding_window"))
        if dflash.get("use_swa") and SLIDING not in layer_types:
            layer_types = [SLIDING] * num_layers
        causal = raw.get("is_causal", dflash.get("causal"))
        train = dflash.get("train_context", raw.get("train_context"))
        rope = {k: v for k, v in dict(q.rope_parameters).items() if k != "type"}
        return cls(hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                   num_attention_heads=raw["num_attention_heads"],
                   num_key_value_heads=q.num_key_value_heads,
                   head_dim=(q.head_dim if q.head_dim is not None
                             else raw["hidden_size"] // raw["num_attention_heads"]),
                   num_hidden_layers=num_layers, num_target_layers=num_target,
                   mask_token_id=mask, target_layer_ids=list(ids), block_size=block,
                   vocab_size=q.vocab_size, rms_norm_eps=float(q.rms_norm_eps),
                   hidden_act=q.hidden_act, attention_bias=bool(q.attention_bias),
                   max_position_embeddings=q.max_position_embeddings, rope_parameters=rope,
                   layer_types=layer_types, sliding_window=window, causal=causal,
                   target_hidden_size=raw.get("target_hidden_size"),
                   tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                   train_context_length=train, sharp_slopes=raw.get("sharp_slopes"),
                   draft_threshold=read_draft_threshold(raw, where),
                   block_size_in_dflash_config=in_dflash,
                   extra={k: v for k, v in raw.items() if k not in _READ_KEYS},
                   dflash_extra={k: v for k, v in dflash.items() if k not in _DFLASH_READ_KEYS})

    def to_public(self) -> dict:
        """The config.json of the public layout (what `from_public` reads back)."""
        out = dict(self.extra)
        out.update(architectures=[ARCHITECTURE], model_type=out.get("model_type", "qwen3"),
                   num_target_layers=self.num_target_layers, hidden_size=self.hidden_size,
                   intermediate_size=self.intermediate_size,
                   num_attention_heads=self.num_attention_heads,
                   num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                   num_hidden_layers=self.num_hidden_layers, vocab_size=self.vocab_size,
                   rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
                   attention_bias=self.attention_bias,
                   max_position_embeddings=self.max_position_embeddings,
                   rope_theta=self.rope_parameters["rope_theta"],
                   layer_types=list(self.layer_types), sliding_window=self.sliding_window,
                   tie_word_embeddings=self.tie_word_embeddings)
        scaling = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" and \
            len(scaling) <= 1 else scaling
        dflash = dict(self.dflash_extra, mask_token_id=self.mask_token_id,
                      target_layer_ids=list(self.target_layer_ids))
        if self.block_size_in_dflash_config:
            dflash["block_size"] = self.block_size
        else:
            out["block_size"] = self.block_size
        if self.causal is not None:
            dflash["causal"] = self.causal
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.train_context_length is not None:
            out["train_context"] = self.train_context_length
        if self.sharp_slopes is not None:
            out["sharp_slopes"] = self.sharp_slopes
        if self.draft_threshold:
            out[DRAFT_THRESHOLD_KEY] = self.draft_threshold
        out["dflash_config"] = dflash
        return out


# ----- modules ------------------------------------------------------------------------------
class ZLabDFlashAttention(nn.Module):
    """One draft layer's attention: block queries over [context ; block] keys (q/k RMSNorm per
    head, RoPE at absolute positions), through sharp attention."""

    def __init__(self, config: ZLabDFlashConfig, layer: int):
        super().__init__()
        d, bias = config.head_dim, config.attention_bias
        self.layer, self.head_dim = layer, d
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.causal, self.window = config.layer_attention(layer)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, L, n * d) -> (B, n, L, d)."""
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, rope: tuple) -> tuple:
        """k_norm'd, rotated keys and the values of rows `x` (B, L, hidden): (B, Hk, L, d) each."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        cos, sin = rope
        k = apply_rotary_pos_emb(k, k, cos, sin)[0]
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x: torch.Tensor, rope: tuple, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                sharp: SharpConfig) -> torch.Tensor:
        """x (B, b, hidden) block rows at the positions of `rope`; ctx_k / ctx_v (B, Hk, T, d)
        the cached context keys / values (positions 0 .. T - 1, the block right after)."""
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads))
        cos, sin = rope
        q = apply_rotary_pos_emb(q, q, cos, sin)[0]
        k, v = self.keys_values(x, rope)
        if self.window is not None and ctx_k.shape[2] > self.window:
            # keys past the window are masked anyway; the kernel's bottom-right alignment holds
            ctx_k, ctx_v = ctx_k[:, :, -self.window:], ctx_v[:, :, -self.window:]
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        out = attend(q, k, v, sharp, layer=self.layer, module=self, causal=self.causal,
                     window=self.window if self.causal else None)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class ZLabDFlashLayer(nn.Module):
    """Pre-norm decoder layer: attention (above), SwiGLU MLP."""

    def __init__(self, config: ZLabDFlashConfig, layer: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = ZLabDFlashAttention(config, layer)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config.qwen3_config())

    def forward(self, x, rope, ctx_k, ctx_v, sharp):
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, sharp)
        return x + self.mlp(self.post_attention_layernorm(x))


class ZLabDFlashDrafter(Drafter):
    """A public z-lab DFlash drafter (see the module docstring): `load(folder)` reads the public
    layout, `save(folder)` writes it. `sharp` (a SharpConfig) selects the attention scaling; its
    default is the published drafter (mode "none") with n_ref = config.train_context."""

    config_class = ZLabDFlashConfig

    def __init__(self, config: ZLabDFlashConfig, sharp: Optional[SharpConfig] = None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(ZLabDFlashLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size,
                            config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config.qwen3_config())
        self.sharp = sharp or SharpConfig(mode="none", n_ref=config.train_context)
        self._init_draft_vocab(None)

    @property
    def max_drafts(self) -> int:
        return self.config.block_size - 1

    # ----- forward pieces ---------------------------------------------------------------------
    def context_features(self, hidden_states) -> torch.Tensor:
        """(1, T, n_features * target_hidden): the target layers' outputs, concatenated in
        target_layer_ids order (`hidden_states` indexed as transformers' output_hidden_states,
        a dict or the full tuple)."""
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    @torch.no_grad()
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list:
        """[(k, v)] per layer, (1, Hk, T, d) each, of context features (1, T, n * target_hidden)
        at `positions` (1, T): hidden_norm(fc(features)) through each layer's k/v projections,
        k_norm and RoPE."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        rope = self.rotary_emb(ctx, positions)
        return [layer.self_attn.keys_values(ctx, rope) for layer in self.layers]

    def block_hidden(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                     cache: list) -> torch.Tensor:
        """norm(draft layers(block)) (1, b, hidden): block_embeds (1, b, hidden) at positions
        (1, b) right after the context whose [(k, v)] per layer is `cache`."""
        x = block_embeds.to(self.fc.weight.dtype)
        rope = self.rotary_emb(x, positions)
        for layer, (k, v) in zip(self.layers, cache):
            x = layer(x, rope, k, v, self.sharp)
        return self.norm(x)

    @torch.no_grad()
    def draft_logits(self, target, last_token: int, position: int, cache: list) -> torch.Tensor:
        """float32 logits (b - 1, target vocab) of the drafts after `last_token` (committed, at
        `position`); row j - 1 predicts the token at position + j. `cache`: [(k, v)] per layer
        of the context positions 0 .. position - 1."""
        b = self.config.block_size
        dev = self.fc.weight.device
        ids = torch.full((1, b), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = last_token
        pos = torch.arange(position, position + b, device=dev)[None]
        h = self.block_hidden(target.get_input_embeddings()(ids), pos, cache)
        return self.head(target, h[0, 1:].to(target.get_output_embeddings().weight.dtype))

    # ----- sessions -------------------------------------------------------------------------
    def start(self, target, prompt_ids: torch.Tensor, hidden_states,
              target_cache=None) -> "ZLabDFlashSession":
        """A draft session after the target's prefill over `prompt_ids` (its context K/V
        computed now from the prompt's features)."""
        return ZLabDFlashSession(self, target, self.context_features(hidden_states))

    # ----- fitting a target -----------------------------------------------------------------
    def target_problems(self, target) -> List[str]:
        """hidden_size (embeddings and LM head borrowed), the features read (target_hidden_size,
        target_layer_ids vs the target's layers), num_target_layers, and mask_token_id (an id of
        the target's vocabulary)."""
        c, t = self.config, target.config
        problems = super().target_problems(target)
        problems += [p for p in feature_layer_problems(c, t)
                     if not (p.startswith("target_hidden_size") and c.target_hidden_size
                             == c.hidden_size and c.hidden_size != t.hidden_size)]
        if c.num_target_layers != t.num_hidden_layers:
            problems.append(f"num_target_layers is {c.num_target_layers}, the target has "
                            f"{t.num_hidden_layers} decoder layers")
        vocab = target.get_input_embeddings().weight.shape[0]
        if not 0 <= c.mask_token_id < vocab:
            problems.append(f"mask_token_id (dflash_config) is {c.mask_token_id}, outside the "
                            f"target's vocabulary of {vocab} tokens")
        return problems

    # ----- conversion -------------------------------------------------------------------------
    @classmethod
    def from_drafter(cls, drafter, target, tokenizer=None) -> "ZLabDFlashDrafter":
        """The public DFlash drafter equal to one of the project's `DFlashDrafter`s (same drafts):
        its config and weights under the public names (the export of `sharpdraft export`).

        Raises:
            ValueError naming the config field that has no public equivalent: `qk_norm` false
                (public DFlash layers RMSNorm each head's queries and keys; the norm divides by
                a per-row RMS, so no weight of a layer without it reproduces it) or a
                `draft_vocab_size` (public DFlash drafts over the target's whole vocabulary
                through its LM head: the drafts would differ).
        """
        c = drafter.config
        if not getattr(c, "qk_norm", False):
            raise ValueError("qk_norm: this DFlash drafter has no q/k RMSNorm, which every public "
                             "DFlash layer applies (a per-row normalisation no weight can "
                             "reproduce): retrain it with --qk-norm to export it")
        if c.draft_vocab_size is not None:
            raise ValueError(f"draft_vocab_size: this DFlash drafter drafts over "
                             f"{c.draft_vocab_size} tokens, a public DFlash drafter over the "
                             f"target's whole vocabulary: retrain it with --draft-vocab 0 to "
                             f"export it")
        t = target.config
        config = ZLabDFlashConfig(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim, num_hidden_layers=c.num_layers,
            num_target_layers=t.num_hidden_layers, mask_token_id=c.mask_token_id,
            target_layer_ids=list(c.target_layer_ids), block_size=c.block_size,
            vocab_size=target.get_input_embeddings().weight.shape[0],
            rms_norm_eps=c.rms_norm_eps, hidden_act=c.hidden_act,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=dict(c.rope_parameters), target_hidden_size=c.target_hidden_size,
            train_context_length=c.train_context, sharp_slopes=c.sharp_slopes,
            draft_threshold=c.draft_threshold,
            extra={"model_type": "qwen3", "torch_dtype": "bfloat16"})
        dtype = drafter.fc.weight.dtype
        with torch.device("meta"):
            public = cls(config, drafter.sharp)
        public.load_state_dict({k: v.detach().clone() for k, v in drafter.state_dict().items()},
                               assign=True)
        public.rotary_emb = Qwen3RotaryEmbedding(config.qwen3_config()).to(
            drafter.fc.weight.device)
        return public.to(dtype).eval()

    # ----- checkpoints ------------------------------------------------------------------------
    def save(self, folder) -> None:
        """Write the public layout: config.json (`ZLabDFlashConfig.to_public`) and
        model.safetensors (the public tensor names)."""
        cfg = self.config.to_public()
        for key in ("dtype", "torch_dtype"):      # the dtype the weights are written in
            if key in cfg:
                cfg[key] = str(self.fc.weight.dtype).removeprefix("torch.")
        save_folder(folder, cfg, self.state_dict())

    @classmethod
    def read_config(cls, folder, overrides: Optional[dict] = None) -> ZLabDFlashConfig:
        """The config of a public DFlash folder's config.json, with `overrides` ({field: value}
        of ZLabDFlashConfig, e.g. block_size) applied and validated.

        Raises:
            FileNotFoundError naming the folder: not a folder, or no config.json.
            ConfigKindError: not a DFlashDraftModel config (another drafter kind).
            ValueError naming the folder, config.json and the field.
        """
        return read_public_config(folder, ZLabDFlashConfig, overrides)

    @classmethod
    def expected_shapes(cls, config: ZLabDFlashConfig) -> Dict[str, tuple]:
        """{tensor name: shape} of the public layout for `config` (built on the meta device)."""
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}

    @classmethod
    def check_weights(cls, folder, config, sharp=None) -> None:
        """Check a folder's tensors (names and shapes, from the file headers) against `config`
        before any weight is read (a pytorch_model.bin is unpickled to see them).

        Raises:
            FileNotFoundError naming the folder: no weights file.
            ValueError naming the folder, the file and the tensor: a shape that differs from the
                one config.json implies, a missing tensor, an unexpected tensor (an own
                embedding, LM head or draft vocabulary is not supported).
        """
        cls._check_shapes(Path(folder), config, weight_index(folder)[1])

    @classmethod
    def _check_shapes(cls, folder: Path, config, shapes: dict) -> None:
        """`check_weights` on `weight_index`'s {name: (file, shape)}."""
        expected = cls.expected_shapes(config)
        own = [k for k in shapes if k not in expected
               and any(s in k for s in ("embed_tokens", "lm_head", "d2t", "t2d"))]
        check_tensors(folder, expected, shapes,
                      "; an own embedding / LM head / draft vocabulary is not supported (the "
                      "target's are used)" if own else "")

    @classmethod
    def load(cls, folder, sharp=None, device: Optional[torch.device] = None, target=None,
             overrides: Optional[dict] = None) -> "ZLabDFlashDrafter":
        """Build a drafter from a public DFlash folder (see the module docstring), in the dtype of
        its fc.weight, on `device` (default CPU), in eval mode.

        Args:
            sharp: the SharpConfig (default: mode "none", n_ref = config.train_context).
            target: when given, the drafter is checked against it (`check_target`).
            overrides: {ZLabDFlashConfig field: value} over config.json (e.g. block_size).

        Raises:
            FileNotFoundError naming the folder: not a folder, no config.json, no weights file.
            ValueError naming the folder, the file and the field or tensor: config.json not
                JSON or invalid (`read_config`), tensors that do not match it (`check_weights`,
                before any weight is read into the model), a mask_embedding.pt (not supported),
                or a target it does not fit.
        """
        folder = Path(folder)
        config = cls.read_config(folder, overrides)
        if (folder / MASK_EMBEDDING_FILE).exists():
            raise ValueError(f"drafter checkpoint {folder}: {MASK_EMBEDDING_FILE} (a separate "
                             f"mask embedding) is not supported")
        _, shapes, state = weight_index(folder)
        cls._check_shapes(folder, config, shapes)
        dev = str(device or "cpu")
        state = read_weights(folder, shapes, state, dev)
        dtype = weights_dtype(folder, state, "fc.weight")
        state = {k: v.to(dtype) for k, v in state.items()}
        with torch.device("meta"):
            model = cls(config, sharp)
        model.load_state_dict(state, assign=True)
        model.rotary_emb = Qwen3RotaryEmbedding(config.qwen3_config()).to(dev)
        if target is not None:
            model.check_target(target, checkpoint=folder)
        return model.eval()


class ZLabDFlashSession:
    """Chain drafting state: per layer, the context keys / values of the committed positions
    0 .. length - 1 (in buffers that grow by doubling)."""

    def __init__(self, drafter: ZLabDFlashDrafter, target, features: torch.Tensor):
        self.drafter, self.target = drafter, target
        self.length = 0
        self._k: list = [None] * len(drafter.layers)
        self._v: list = [None] * len(drafter.layers)
        self._extend(features)

    @staticmethod
    def _append(buf: Optional[torch.Tensor], new: torch.Tensor, length: int) -> torch.Tensor:
        need = length + new.shape[2]
        if buf is None or buf.shape[2] < need:
            cap = max(need, 2 * (0 if buf is None else buf.shape[2]), 64)
            grown = new.new_empty(*new.shape[:2], cap, new.shape[3])
            if buf is not None:
                grown[:, :, :length] = buf[:, :, :length]
            buf = grown
        buf[:, :, length:need] = new
        return buf

    def _extend(self, features: torch.Tensor) -> None:
        n = features.shape[1]
        if n == 0:
            return
        pos = torch.arange(self.length, self.length + n, device=self.drafter.fc.weight.device)
        for i, (k, v) in enumerate(self.drafter.context_kv(features, pos[None])):
            self._k[i] = self._append(self._k[i], k, self.length)
            self._v[i] = self._append(self._v[i], v, self.length)
        self.length += n

    @property
    def cache(self) -> list:
        """[(k, v)] per layer, (1, Hk, length, d) views of the context keys / values."""
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self._k, self._v)]

    def propose(self, last: int, position: int, draw) -> tuple:
        if position != self.length:
            raise ValueError(f"propose: position {position} is not the number of committed "
                             f"context positions ({self.length})")
        return draw_rows(self.drafter.draft_logits(self.target, last, position, self.cache),
                         draw)

    def commit(self, accepted: List[int], hidden_states) -> None:
        """Extend the context K/V with the features of the verification rows now committed
        ([last] + the accepted drafts: the first len(accepted) rows)."""
        self._extend(self.drafter.context_features(hidden_states)[:, :len(accepted)])

    def state_bytes(self) -> int:
        return state_bytes(*[t for kv in self.cache for t in kv])


def untrained(target, tokenizer=None, layers: int = 2, block_size: int = 16,
              overrides: Optional[dict] = None, mask_token_id: Optional[int] = None):
    """A random public-layout DFlash drafter for `target` (the registry's `untrained` hook:
    (target, tokenizer, layers, block_size, overrides)): the target's geometry, `layers` draft
    layers reading `build_target_layer_ids(target layers, layers)`, the mask token from the
    tokenizer (`common.default_mask_token_id`) or `mask_token_id` (default: the last id)."""
    from .common import default_mask_token_id
    t = target.config
    if mask_token_id is None:
        mask_token_id = (default_mask_token_id(tokenizer) if tokenizer is not None
                         else target.get_input_embeddings().weight.shape[0] - 1)
    rope = dict(getattr(t, "rope_parameters", None) or {"rope_type": "default",
                                                          "rope_theta": 10000.0})
    cfg = ZLabDFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        num_hidden_layers=layers, num_target_layers=t.num_hidden_layers,
        mask_token_id=int(mask_token_id),
        target_layer_ids=build_target_layer_ids(t.num_hidden_layers, layers),
        block_size=block_size, vocab_size=target.get_input_embeddings().weight.shape[0],
        rms_norm_eps=t.rms_norm_eps, hidden_act=t.hidden_act,
        max_position_embeddings=t.max_position_embeddings, rope_parameters=rope)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return ZLabDFlashDrafter(cfg).eval()


__all__ = ["ZLabDFlashConfig", "ZLabDFlashDrafter", "ZLabDFlashSession",
           "build_target_layer_ids", "untrained"]
