"""The z-lab DFlash format: a public DFlash drafter's folder (z-lab/dflash `dflash/model.py`,
`DFlashDraftModel`; served natively by vLLM's `qwen3_dflash.py` and SGLang), its config.json
translated to and from `ZLabDFlashConfig`, and what this format checks beyond the shared load
(`formats.public`). The drafter that runs it is `drafters.zlab_dflash.ZLabDFlashDrafter`.

    config.json   architectures ["DFlashDraftModel"], model_type "qwen3", block_size (top level,
                  or in dflash_config), num_target_layers, dflash_config {mask_token_id,
                  target_layer_ids}, the Qwen3 geometry fields
    weights       model.safetensors, or shards listed by model.safetensors.index.json, or a
                  pytorch_model.bin (read with torch.load(weights_only=True)); the tensors
                  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm
                  .weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
                  layers.{i}.{input,post_attention}_layernorm.weight, fc.weight
                  [H, n_features * H], hidden_norm.weight, norm.weight (no embedding and no LM
                  head: the target's are borrowed; a separate mask_embedding.pt is refused)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from transformers import Qwen3Config

from ..config_checks import DEFAULT_TRAIN_CONTEXT, ConfigKindError, check_draft_threshold, is_int
from .files import CONFIG_FILE
from .public import (DRAFT_THRESHOLD_KEY, PublicFormat, check_int_fields, check_layer_fields,
                     read_draft_threshold, write_extensions)

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
        check_int_fields(self, {"hidden_size": 1, "intermediate_size": 1,
                                "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1,
                                "num_hidden_layers": 1, "num_target_layers": 1, "block_size": 2,
                                "mask_token_id": 0, "vocab_size": 1, "target_hidden_size": 1,
                                "max_position_embeddings": 1})
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
        check_layer_fields(self)
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
        write_extensions(out, self)
        out["dflash_config"] = dflash
        return out



class ZLabDFlashFormat(PublicFormat):
    """What loading a z-lab DFlash folder checks beyond the shared load: no separate mask
    embedding file, and no own embedding / LM head / draft vocabulary among the tensors."""

    config_class = ZLabDFlashConfig

    @classmethod
    def prepare_config(cls, folder: Path, config, target):
        """Refuse a mask_embedding.pt (ValueError naming the folder and the file)."""
        if (folder / MASK_EMBEDDING_FILE).exists():
            raise ValueError(f"drafter checkpoint {folder}: {MASK_EMBEDDING_FILE} (a separate "
                             f"mask embedding) is not supported")
        return config

    @classmethod
    def unexpected_hint(cls, config, shapes: dict) -> str:
        expected = cls.expected_shapes(config)
        own = [k for k in shapes if k not in expected
               and any(s in k for s in ("embed_tokens", "lm_head", "d2t", "t2d"))]
        return ("; an own embedding / LM head / draft vocabulary is not supported (the target's "
                "are used)" if own else "")
