"""EAGLE-3 drafters in their public checkpoint layout (SafeAILab/EAGLE, SpecForge), run with sharp
attention, and the export of the project's own EAGLE-3 drafters to that layout.

The published EAGLE-3 drafter (SafeAILab/EAGLE `eagle/model/cnets.py` `Model`, read at cb7e084;
SpecForge `specforge/modeling/draft/llama3_eagle.py` `LlamaForCausalLMEagle3`; served by vLLM
`vllm/model_executor/models/llama_eagle3.py` and SGLang `python/sglang/srt/models/llama_eagle3.py`)
is the project's `Eagle3Drafter` with `norm_features=False`, `feed_normed_output=False` and a unit
`feature_scale`: g = fc(concat of raw target features), q/k/v over [input_layernorm(embedding);
hidden_norm(g)], the residual stream starting from g, the layer's un-normalised output fed to the
next draft row, logits = lm_head(norm(output)). What differs is the checkpoint:

    config.json   architectures ["LlamaForCausalLMEagle3"] (SpecForge), ["Eagle3LlamaForCausalLM"]
                  or ["Eagle3MiniMaxM2ForCausalLM"] (vLLM names of the same layer), or
                  ["LlamaForCausalLM"] together with a draft_vocab_size key (SafeAILab's
                  traineagle3/config.json, which vLLM renames to Eagle3LlamaForCausalLM); the Llama
                  geometry (hidden_size, intermediate_size, num_attention_heads,
                  num_key_value_heads, head_dim (default hidden_size / heads), rms_norm_eps,
                  hidden_act, max_position_embeddings, rope_theta + rope_scaling or
                  rope_parameters), num_hidden_layers 1, vocab_size (the target's vocabulary),
                  draft_vocab_size (default vocab_size), target_hidden_size (default hidden_size),
                  the aux layers (below), SpecForge's fc_norm (EAGLE 3.1: an RMSNorm per feature
                  before fc, = our `norm_features`)
    weights       model.safetensors, shards listed by model.safetensors.index.json, or
                  pytorch_model.bin (torch.load(weights_only=True)): fc.weight [H, n * H_t],
                  midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H],
                  midlayer.self_attn.{q,k,v}_proj.weight [heads * d, 2H],
                  midlayer.self_attn.o_proj.weight [H, heads * d], midlayer.mlp.{gate,up,down}_proj
                  .weight, norm.weight [H], lm_head.weight [draft_vocab, H] (own LM head;
                  optional only for a full-vocabulary drafter, which then borrows the target's),
                  d2t int64 [draft_vocab] (OFFSETS: target id = draft id + d2t[draft id]; may be
                  absent when draft_vocab_size == vocab_size), t2d bool [vocab] (written, never
                  read by vLLM / SGLang), embed_tokens.weight [vocab, H] (optional: without it
                  the target's embedding is used, as vLLM does), fc_norm.{i}.weight [H_t] (with
                  fc_norm)

Internally the drafter keeps the project's conventions: `d2t` holds ABSOLUTE target ids (so
`to_target_vocab` and tree drafting work unchanged), layer tensors sit at the top level, and
`target_layer_ids` use the project's numbering (id l = output of decoder layer l =
transformers' hidden_states[l + 1]).

Aux layers. The public drafters read the target's residual stream at the INPUT of some target
layers, "aux" id a = input of layer a = hidden_states[a] (SafeAILab `modeling_llama_kv.py`
captures before layers 2, L // 2 and L - 3; vLLM's `llama.py` appends hidden_states + residual
before layer idx), so l = a - 1. Every engine concatenates them in ascending layer order, whatever
order a config lists them in; so the ids are sorted here, and a repeated id (which an engine would
capture once, leaving fc short of a feature) is refused. Where the ids come from, first match:

    eagle_aux_hidden_state_layer_ids (top level)   aux numbering, what vLLM reads
        (`get_eagle3_aux_layers_from_config`) -> l = a - 1
    eagle_config.eagle_aux_hidden_state_layer_ids  OUTPUT numbering, what SGLang reads (its
        targets' `set_eagle3_layers_to_capture` add 1 to get the layer whose input they capture)
        and what SpecForge trains with (`resolve_eagle_capture_layers`, default
        [1, L // 2 - 1, L - 4]) -> l = id (vLLM's newer runners read this nested list as aux
        ids: the engines disagree by one; this module follows SGLang / SpecForge, who write it)
    neither                                        the default aux layers (2, L // 2, L - 3) of
        an L-layer target: resolved by `load(..., target=...)`; `read_config` still succeeds
        (detect_kind), with target_layer_ids None, and `load` without a target raises a
        ValueError saying so.

When both are present they must agree (top = nested + 1). `save` writes both (top level
[l + 1], nested [l]), so vLLM and SGLang capture the same layers.

The draft attention is causal over the drafter's own KV cache (tree rows see the committed rows
and their ancestors) through `sharpdraft_ext.sharp_attention`: the drafter's `sharp` SharpConfig
with mode "none" is the published drafter, "fixed_slope" SharpDraft (n_ref = config.train_context:
a `train_context` recorded in config.json, else 2048). RoPE is computed from positions (no table),
so a public max_position_embeddings below the target's (SafeAILab ships 2048) limits nothing; the
value is kept (it matters only to rope types that read it, e.g. "dynamic", as in the references).

Refused variants (one-line ValueErrors naming the file and field): num_hidden_layers != 1,
tie_word_embeddings, attention / MLP / fc biases, vLLM's norm_before_residual, SpecForge's
norm_output false, eagle_config.use_aux_hidden_state false, multimodal RoPE (mrope_section).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..attention import SharpConfig
from .base import (CONFIG_FILE, DEFAULT_TRAIN_CONTEXT, ConfigKindError, check_config,
                   target_geometry)
from .eagle3 import Eagle3Config, Eagle3Drafter
from .public_files import (DRAFT_THRESHOLD_KEY, check_tensors, is_int, read_draft_threshold,
                           read_public_config, read_weights, save_folder, weight_index,
                           weights_dtype)

ARCHITECTURE = "LlamaForCausalLMEagle3"           # what `save` writes (SpecForge's name)
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM", "Eagle3MiniMaxM2ForCausalLM")
SAFEAILAB_ARCHITECTURE = "LlamaForCausalLM"       # accepted with a draft_vocab_size key only
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
EXTRAS_KEY = "sharpdraft"                         # our drafting options in config.json
DRAFTING_OPTIONS = ("chain_length", "tree_topk", "tree_depth", "tree_tokens")
_MIDLAYER = ("input_layernorm.", "hidden_norm.", "post_attention_layernorm.", "self_attn.",
             "mlp.")
_ROPE_TYPES = ("default",) + tuple(ROPE_INIT_FUNCTIONS)
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# config.json keys the config reads (the rest is kept in `extra` and written back by `save`).
_READ_KEYS = {"architectures", "model_type", "hidden_size", "intermediate_size",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
              "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps",
              "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling",
              "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias", "bias",
              "qkv_bias", "norm_before_residual", "norm_output", "fc_norm", "use_aux_norm",
              AUX_KEY, "eagle_config", "train_context", "sharp_slopes", EXTRAS_KEY,
              DRAFT_THRESHOLD_KEY}
_EAGLE_READ_KEYS = {AUX_KEY, "use_aux_hidden_state"}


def default_aux_layers(num_target_layers: int) -> List[int]:
    """The aux layer ids the public EAGLE-3 reads from an L-layer target when its config names
    none: (2, L // 2, L - 3), aux id a = the input of target layer a = hidden_states[a]
    (SafeAILab `eagle/model/modeling_llama_kv.py`; vLLM `get_eagle3_aux_hidden_state_layers`;
    SGLang `set_eagle3_layers_to_capture(None)`)."""
    L = num_target_layers
    return [2, L // 2, L - 3]


def _aux_problem(aux: List[int], num_target_layers: int) -> Optional[str]:
    """Why aux ids cannot be read from an L-layer target (ids 1 .. L - 1, distinct), or None."""
    L = num_target_layers
    if len(set(aux)) != len(aux):
        return (f"repeat a layer ({aux}): an engine captures each layer once, so fc would lack "
                f"a feature")
    bad = [a for a in aux if not 1 <= a <= L - 1]
    if bad:
        return (f"name {bad}, outside the aux ids 1 .. {L - 1} of a {L}-layer target (aux id a "
                f"is the input of target layer a; 0, the embedding, is not supported)")
    return None


def _json(v) -> str:
    return json.dumps(v)


# ----- config ------------------------------------------------------------------------------------
@dataclass
class SpecForgeEagle3Config(Eagle3Config):
    """A public EAGLE-3 drafter's config.json, resolved (see the module docstring; `from_public`
    reads it, `to_public` writes it). The `Eagle3Config` fields keep their meaning; in addition:

    target_layer_ids: the project's ids (l = aux id - 1), ascending; None while unresolved (the
    config names no aux layers and no target was given). num_features: the number of fused
    features (len(target_layer_ids), 3 while unresolved). vocab_size: the target vocabulary (t2d's
    length, the own embedding's rows). draft_vocab_size: None when the drafter has no d2t
    (identity over the full vocabulary), else d2t's length (<= vocab_size). own_lm_head /
    own_embedding: whether lm_head.weight / embed_tokens.weight are the drafter's (read from the
    weight files by `load`). norm_features: SpecForge's fc_norm. records_train_context: whether
    config.json records `train_context` (else n_ref defaults to 2048). extra / eagle_extra: the
    other keys of config.json / eagle_config, written back.
    """

    target_layer_ids: Optional[List[int]] = None
    train_context: int = DEFAULT_TRAIN_CONTEXT
    norm_features: bool = False
    feed_normed_output: bool = False
    max_position_embeddings: int = 2048
    vocab_size: int = 0
    num_features: int = 3
    own_lm_head: bool = True
    own_embedding: bool = False
    records_train_context: bool = False
    extra: dict = field(default_factory=dict)
    eagle_extra: dict = field(default_factory=dict)

    def __post_init__(self):
        name = type(self).__name__
        check_config(self, {"chain_length": 1, "tree_topk": 1, "tree_depth": 1,
                            "tree_tokens": 1, "train_context": 1})
        for f, lo in (("vocab_size", 2), ("target_hidden_size", 1), ("num_features", 1),
                      ("max_position_embeddings", 1)):
            v = getattr(self, f)
            if not is_int(v) or v < lo:
                raise ValueError(f"{name}.{f} must be an integer >= {lo}, got {v!r}")
        ids = self.target_layer_ids
        if ids is not None:
            if (not isinstance(ids, list) or not ids
                    or not all(is_int(i) and i >= 0 for i in ids)):
                raise ValueError(f"{name}.target_layer_ids must be None or a non-empty list of "
                                 f"layer ids >= 0, got {ids!r}")
            if any(b <= a for a, b in zip(ids, ids[1:])):
                raise ValueError(f"{name}.target_layer_ids must be strictly increasing (the "
                                 f"public drafters concatenate the features in layer order), "
                                 f"got {ids}")
            self.num_features = len(ids)
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"{name}.draft_vocab_size {self.draft_vocab_size} exceeds "
                             f"vocab_size {self.vocab_size}")
        if not self.own_lm_head and self.draft_vocab_size not in (None, self.vocab_size):
            raise ValueError(f"{name}: a reduced draft vocabulary (draft_vocab_size "
                             f"{self.draft_vocab_size} < vocab_size {self.vocab_size}) needs its "
                             f"own lm_head.weight")
        if self.feed_normed_output:
            raise ValueError(f"{name}.feed_normed_output: the public EAGLE-3 feeds the layer's "
                             f"un-normalised output forward")
        if not (isinstance(self.rms_norm_eps, (int, float)) and not isinstance(
                self.rms_norm_eps, bool) and self.rms_norm_eps > 0):
            raise ValueError(f"{name}.rms_norm_eps must be a number > 0, got "
                             f"{self.rms_norm_eps!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"{name}.hidden_act {self.hidden_act!r} is not an activation "
                             f"transformers knows")
        rope = self.rope_parameters
        if not isinstance(rope, dict) or not isinstance(rope.get("rope_theta"), (int, float)):
            raise ValueError(f"{name}.rope_parameters must be an object with a numeric "
                             f"rope_theta, got {rope!r}")
        if rope.get("rope_type", "default") not in _ROPE_TYPES:
            raise ValueError(f"{name}.rope_parameters: rope_type {rope.get('rope_type')!r} is "
                             f"not one of {', '.join(_ROPE_TYPES)}")
        if "mrope_section" in rope:
            raise ValueError(f"{name}.rope_parameters: multimodal RoPE (mrope_section) is not "
                             f"supported")
        if self.sharp_slopes is not None and not isinstance(self.sharp_slopes, list):
            raise ValueError(f"{name}.sharp_slopes must be null or a list, got "
                             f"{self.sharp_slopes!r}")

    @property
    def resolved(self) -> bool:
        """Whether the target layers are known (config.json named them, or a target resolved
        the default)."""
        return self.target_layer_ids is not None

    @property
    def aux_layer_ids(self) -> Optional[List[int]]:
        """The aux ids (vLLM numbering, a = l + 1) of target_layer_ids, or None."""
        return None if self.target_layer_ids is None else [i + 1 for i in self.target_layer_ids]

    def resolve_for(self, target_config, where: str = CONFIG_FILE) -> "SpecForgeEagle3Config":
        """This config with the default aux layers (2, L // 2, L - 3) of `target_config`'s L
        layers when it names none (else itself).

        Raises:
            ValueError naming `where`: the default ids repeat a layer or fall outside the target
                (a target of fewer than 6 layers), or their number differs from num_features.
        """
        if self.resolved:
            return self
        L = target_config.num_hidden_layers
        aux = default_aux_layers(L)
        problem = _aux_problem(aux, L)
        if problem:
            raise ValueError(f"{where} names no {AUX_KEY}, and the default aux layers (2, L // 2, "
                             f"L - 3) of the {L}-layer target {problem}; name them in "
                             f"config.json or pass overrides={{'target_layer_ids': [...]}}")
        if len(aux) != self.num_features:
            raise ValueError(f"{where}: the default aux layers {aux} are {len(aux)}, the config "
                             f"fuses {self.num_features} features")
        return dataclasses.replace(self, target_layer_ids=[a - 1 for a in aux])

    # ----- config.json ----------------------------------------------------------------------
    @classmethod
    def from_public(cls, raw: dict, where: str = CONFIG_FILE) -> "SpecForgeEagle3Config":
        """Parse a public config.json (a dict); see the module docstring for the fields read.
        The weight-dependent fields (own_lm_head, own_embedding, a draft_vocab_size equal to
        vocab_size without d2t) keep their defaults until `load` sees the weights.

        Raises:
            ConfigKindError naming `where`: not an EAGLE-3 config (architectures).
            ValueError naming `where` and the field: a missing or mistyped field, an invalid
                value, a variant not supported, or aux layer ids that repeat, are negative,
                name aux id 0 or disagree between the top level and eagle_config.
        """
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must hold a JSON object")
        archs = raw.get("architectures")
        ok = isinstance(archs, list) and (
            any(a in ARCHITECTURES for a in archs)
            or (SAFEAILAB_ARCHITECTURE in archs and "draft_vocab_size" in raw))
        if not ok:
            raise ConfigKindError(
                f"{where} is not a public EAGLE-3 config (architectures {_json(archs)}, expected "
                f"one of {list(ARCHITECTURES)}, or {SAFEAILAB_ARCHITECTURE!r} with a "
                f"draft_vocab_size)")

        def get_int(key, default=None, lo=1, source=raw, label=None):
            label = label or key
            if key not in source or source[key] is None:
                if default is None:
                    raise ValueError(f"{where}: missing {label}")
                return default
            v = source[key]
            if not is_int(v) or v < lo:
                raise ValueError(f"{where}: {label} must be an integer >= {lo}, got {_json(v)}")
            return v

        def get_number(key, default):
            v = raw.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{where}: {key} must be a number > 0, got {_json(v)}")
            return float(v)

        hidden = get_int("hidden_size")
        heads = get_int("num_attention_heads")
        layers = get_int("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"{where}: num_hidden_layers is {layers}; only the one-layer "
                             f"EAGLE-3 drafter (midlayer) is supported")
        vocab = get_int("vocab_size", lo=2)
        draft_vocab = get_int("draft_vocab_size", vocab, lo=2)
        if draft_vocab > vocab:
            raise ValueError(f"{where}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "bias", "qkv_bias",
                    "norm_before_residual"):
            if raw.get(key):
                raise ValueError(f"{where}: {key} {_json(raw[key])} is not supported (the "
                                 f"public EAGLE-3 layer has "
                                 + ("its own untied lm_head)" if key == "tie_word_embeddings"
                                    else "no biases)" if "bias" in key
                                    else "the residual taken before hidden_norm)"))
        if raw.get("norm_output", True) is not True:
            raise ValueError(f"{where}: norm_output {_json(raw['norm_output'])} is not "
                             f"supported (logits from the un-normalised output)")
        fc_norm = raw.get("fc_norm", raw.get("use_aux_norm", False))
        if not isinstance(fc_norm, bool) and fc_norm is not None:
            raise ValueError(f"{where}: fc_norm must be true or false, got {_json(fc_norm)}")
        act = raw.get("hidden_act", "silu")
        if act not in ACT2FN:
            raise ValueError(f"{where}: hidden_act {_json(act)} is not an activation "
                             f"transformers knows")

        # RoPE: rope_parameters (transformers 5), else rope_theta + rope_scaling
        if raw.get("rope_parameters") is not None:
            rope = raw["rope_parameters"]
            if not isinstance(rope, dict) or not isinstance(rope.get("rope_theta"), (int, float)):
                raise ValueError(f"{where}: rope_parameters must be an object with a numeric "
                                 f"rope_theta, got {_json(rope)}")
            rope, label = dict(rope), "rope_parameters"
        else:
            theta = get_number("rope_theta", 10000.0)
            scaling = raw.get("rope_scaling") or {}
            if not isinstance(scaling, dict):
                raise ValueError(f"{where}: rope_scaling must be an object or null, got "
                                 f"{_json(scaling)}")
            rope, label = dict(scaling, rope_theta=theta), "rope_scaling"
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        rope.pop("type", None)
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"{where}: {label}.rope_type {_json(rope_type)} is not one of "
                             f"{', '.join(_ROPE_TYPES)}")
        if "mrope_section" in rope:
            raise ValueError(f"{where}: {label}.mrope_section (multimodal RoPE) is not supported")
        if rope_type in ("linear", "dynamic", "llama3", "yarn") and not isinstance(
                rope.get("factor"), (int, float)):
            raise ValueError(f"{where}: {label} of type {rope_type} needs a numeric factor")
        rope = {"rope_type": rope_type, **rope}

        # aux layers
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{where}: eagle_config must be an object, got {_json(eagle)}")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError(f"{where}: eagle_config.use_aux_hidden_state "
                             f"{_json(eagle['use_aux_hidden_state'])} is not supported (an "
                             f"EAGLE-3 drafter fuses aux features through fc)")

        def id_list(source, label, lo):
            ids = source.get(AUX_KEY)
            if ids is None:
                return None
            if (not isinstance(ids, list) or not ids
                    or not all(is_int(i) for i in ids)):
                raise ValueError(f"{where}: {label} must be a non-empty list of integers, got "
                                 f"{_json(ids)}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{where}: {label} {ids} repeat a layer (an engine captures "
                                 f"each layer once, so fc would lack a feature)")
            if min(ids) < lo:
                raise ValueError(f"{where}: {label} {ids} must be >= {lo}"
                                 + (" (aux id a is the input of target layer a; 0, the "
                                    "embedding, is not supported)" if lo == 1 else ""))
            return sorted(ids)

        top = id_list(raw, AUX_KEY, 1)                               # aux numbering
        nested = id_list(eagle, f"eagle_config.{AUX_KEY}", 0)        # output numbering
        if top is not None and nested is not None and [a - 1 for a in top] != nested:
            raise ValueError(f"{where}: {AUX_KEY} {top} (aux ids: inputs of those layers) and "
                             f"eagle_config.{AUX_KEY} {nested} (outputs of those layers) name "
                             f"different target layers (expected the nested ids + 1 at the top "
                             f"level)")
        layer_ids = [a - 1 for a in top] if top is not None else nested

        extras = raw.get(EXTRAS_KEY) or {}
        if not isinstance(extras, dict) or set(extras) - set(DRAFTING_OPTIONS):
            raise ValueError(f"{where}: {EXTRAS_KEY} must be an object of "
                             f"{', '.join(DRAFTING_OPTIONS)}, got {_json(extras)}")
        for key, v in extras.items():
            if not is_int(v) or v < 1:
                raise ValueError(f"{where}: {EXTRAS_KEY}.{key} must be an integer >= 1, got "
                                 f"{_json(v)}")
        train = raw.get("train_context")
        if train is not None and (not is_int(train) or train < 1):
            raise ValueError(f"{where}: train_context must be an integer >= 1, got {_json(train)}")
        slopes = raw.get("sharp_slopes")
        if slopes is not None and not isinstance(slopes, list):
            raise ValueError(f"{where}: sharp_slopes must be a list, got {_json(slopes)}")
        return cls(hidden_size=hidden, intermediate_size=get_int("intermediate_size"),
                   num_attention_heads=heads,
                   num_key_value_heads=get_int("num_key_value_heads", heads),
                   head_dim=get_int("head_dim", max(1, hidden // heads)),
                   target_hidden_size=get_int("target_hidden_size", hidden),
                   target_layer_ids=layer_ids,
                   num_features=len(layer_ids) if layer_ids is not None else 3,
                   train_context=train or DEFAULT_TRAIN_CONTEXT,
                   records_train_context=train is not None, sharp_slopes=slopes,
                   draft_threshold=read_draft_threshold(raw, where),
                   draft_vocab_size=draft_vocab, vocab_size=vocab,
                   norm_features=bool(fc_norm), feed_normed_output=False,
                   rms_norm_eps=get_number("rms_norm_eps", 1e-6), hidden_act=act,
                   max_position_embeddings=get_int("max_position_embeddings", 2048),
                   rope_parameters=rope, **extras,
                   extra={k: v for k, v in raw.items() if k not in _READ_KEYS},
                   eagle_extra={k: v for k, v in eagle.items() if k not in _EAGLE_READ_KEYS})

    def to_public(self) -> dict:
        """The config.json of the public layout (what `from_public` reads back): architectures
        ["LlamaForCausalLMEagle3"], the Llama fields, num_hidden_layers 1, vocab_size,
        draft_vocab_size (always written: SGLang borrows the target's LM head when it is absent),
        target_hidden_size, the aux ids at the top level (vLLM, aux numbering) and in
        eagle_config (SGLang / SpecForge, output numbering), fc_norm when norm_features, and our
        extras: train_context (when recorded), sharp_slopes (when calibrated), draft_threshold
        (when measured, > 0) and "sharpdraft": {chain_length, tree_topk, tree_depth,
        tree_tokens}.

        Raises:
            ValueError: the target layers are unresolved (nothing to write for them).
        """
        if not self.resolved:
            raise ValueError("SpecForgeEagle3Config.to_public: target_layer_ids are unresolved "
                             "(load the drafter with target= first)")
        out = dict(self.extra)
        rope = dict(self.rope_parameters)
        theta = rope.pop("rope_theta")
        scaling = None if rope.get("rope_type", "default") == "default" and len(rope) <= 1 \
            else rope
        out.update(architectures=[ARCHITECTURE], model_type="llama",
                   hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                   num_attention_heads=self.num_attention_heads,
                   num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                   num_hidden_layers=1, hidden_act=self.hidden_act,
                   rms_norm_eps=self.rms_norm_eps,
                   max_position_embeddings=self.max_position_embeddings,
                   rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=False,
                   vocab_size=self.vocab_size,
                   draft_vocab_size=self.draft_vocab_size or self.vocab_size,
                   target_hidden_size=self.target_hidden_size)
        out[AUX_KEY] = self.aux_layer_ids
        out["eagle_config"] = dict(self.eagle_extra, **{AUX_KEY: list(self.target_layer_ids)})
        if self.norm_features:
            out["fc_norm"] = True
        if self.records_train_context:
            out["train_context"] = self.train_context
        if self.sharp_slopes is not None:
            out["sharp_slopes"] = self.sharp_slopes
        if self.draft_threshold:
            out[DRAFT_THRESHOLD_KEY] = self.draft_threshold
        out[EXTRAS_KEY] = {k: getattr(self, k) for k in DRAFTING_OPTIONS}
        return out


# ----- the drafter -------------------------------------------------------------------------------
def _public_name(name: str) -> str:
    """Our module's state_dict name -> the public tensor name."""
    if name.startswith(_MIDLAYER):
        return "midlayer." + name
    if name.startswith("feature_norms."):
        return "fc_norm." + name[len("feature_norms."):]
    return name


def _internal_name(name: str) -> str:
    """A public tensor name -> our module's state_dict name."""
    if name.startswith("midlayer."):
        return name[len("midlayer."):]
    if name.startswith("fc_norm."):
        return "feature_norms." + name[len("fc_norm."):]
    return name


class SpecForgeEagle3Drafter(Eagle3Drafter):
    """A public EAGLE-3 drafter (see the module docstring): `load(folder)` reads the SafeAILab /
    SpecForge layout, `save(folder)` writes it, `from_drafter` converts one of the project's
    own EAGLE-3 drafters. Chain and tree drafting are `Eagle3Drafter`'s (its sessions call
    `head` and `token_embeddings`, overridden here for the own LM head and embedding).

    Modules beyond `Eagle3Drafter`'s: lm_head (nn.Linear H -> draft vocabulary, no bias; None
    when borrowing the target's), embed_tokens (nn.Embedding vocab x H; None when the target's
    is used), t2d (bool buffer [vocab_size], None without d2t). `d2t` holds absolute target ids.
    """

    config_class = SpecForgeEagle3Config

    def __init__(self, config: SpecForgeEagle3Config, sharp: Optional[SharpConfig] = None):
        if not config.resolved:
            raise ValueError("SpecForgeEagle3Drafter: config.target_layer_ids are unresolved "
                             "(SpecForgeEagle3Config.resolve_for(target.config))")
        super().__init__(config, sharp)
        h, vocab = config.hidden_size, config.vocab_size
        self.lm_head = (nn.Linear(h, config.draft_vocab_size or vocab, bias=False)
                        if config.own_lm_head else None)
        self.embed_tokens = nn.Embedding(vocab, h) if config.own_embedding else None
        if self.d2t is not None:
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[self.d2t] = True
            self.register_buffer("t2d", t2d, persistent=True)
        else:
            self.t2d = None

    @classmethod
    def from_drafter(cls, drafter: Eagle3Drafter, target,
                     tokenizer=None) -> "SpecForgeEagle3Drafter":
        """The module's `from_drafter` (the exact public equivalent of one of the project's
        EAGLE-3 drafters), as a class method with the signature the public-format classes share
        (`tokenizer` unused). Raises ValueError naming the option, as `from_drafter`."""
        return from_drafter(drafter, target)

    # ----- what the sessions call -------------------------------------------------------------
    def head(self, target, h: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary: the own lm_head (rows = draft ids), else the
        target's LM head (rows d2t, `Drafter.head`)."""
        if self.lm_head is None:
            return super().head(target, h)
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()

    def draft_head_weight(self, target) -> torch.Tensor:
        """The weight `head` applies: the own lm_head's, else the target LM head's rows d2t."""
        if self.lm_head is None:
            return super().draft_head_weight(target)
        return self.lm_head.weight

    def token_embeddings(self, target) -> nn.Module:
        """The own embed_tokens when the checkpoint has one, else the target's embedding."""
        return self.embed_tokens if self.embed_tokens is not None \
            else target.get_input_embeddings()

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """`Drafter.set_draft_vocab`, keeping t2d in step with d2t."""
        super().set_draft_vocab(target_ids)
        with torch.no_grad():
            self.t2d.zero_()
            self.t2d[self.d2t] = True

    # ----- fitting a target -------------------------------------------------------------------
    def target_problems(self, target) -> List[str]:
        """Why this drafter cannot draft for `target`, one line per config field: vocab_size vs
        the target's vocabulary, hidden_size where the target's embedding or LM head is
        borrowed, target_hidden_size, and the aux layers (ids 1 .. L - 1 of an L-layer
        target)."""
        c, t = self.config, target.config
        problems = []
        vocab = target.get_output_embeddings().weight.shape[0]
        if c.vocab_size != vocab:
            problems.append(f"vocab_size is {c.vocab_size}, the target's vocabulary has {vocab} "
                            f"tokens")
        borrowed = [what for what, own in (("token embeddings (no embed_tokens.weight)",
                                            self.embed_tokens), ("LM head (no lm_head.weight)",
                                                                 self.lm_head)) if own is None]
        if borrowed and c.hidden_size != t.hidden_size:
            problems.append(f"hidden_size is {c.hidden_size}, the target's hidden_size is "
                            f"{t.hidden_size} (the drafter uses the target's "
                            f"{' and '.join(borrowed)})")
        if c.target_hidden_size != t.hidden_size:
            problems.append(f"target_hidden_size is {c.target_hidden_size}, the target's "
                            f"hidden_size is {t.hidden_size}")
        problem = _aux_problem(c.aux_layer_ids, t.num_hidden_layers)
        if problem:
            problems.append(f"{AUX_KEY} {c.aux_layer_ids} (target_layer_ids "
                            f"{c.target_layer_ids}) {problem}")
        return problems

    # ----- the public state ---------------------------------------------------------------------
    def public_state_dict(self) -> Dict[str, torch.Tensor]:
        """The tensors under their public names: feature_scale folded into fc (fc.weight *
        scale per input column), d2t as offsets (int64), t2d, lm_head / embed_tokens when own.

        Raises:
            ValueError: a non-unit feature_scale with fc_norm (a per-feature RMSNorm after the
                scale: no exact fold).
        """
        sd = self.state_dict()
        scale = sd.pop("feature_scale")
        if not bool((scale == 1).all()):
            if self.feature_norms is not None:
                raise ValueError("SpecForgeEagle3Drafter: a non-unit feature_scale before fc_norm "
                                 "cannot be folded into fc")
            sd["fc.weight"] = (sd["fc.weight"].float() * scale.float()[None]).to(
                sd["fc.weight"].dtype)
        out = {_public_name(k): v for k, v in sd.items()}
        if "d2t" in out:
            out["d2t"] = (out["d2t"] - torch.arange(out["d2t"].numel(),
                                                    device=out["d2t"].device)).long()
        return out

    @classmethod
    def expected_shapes(cls, config: SpecForgeEagle3Config) -> Dict[str, tuple]:
        """{public tensor name: shape} for a resolved `config` (built on the meta device)."""
        with torch.device("meta"):
            sd = cls(config).state_dict()
        return {_public_name(k): tuple(v.shape) for k, v in sd.items() if k != "feature_scale"}

    @staticmethod
    def fit_to_weights(config: SpecForgeEagle3Config, names) -> SpecForgeEagle3Config:
        """The config with the weight-dependent fields read off the tensor names of a folder:
        own_embedding (embed_tokens.weight present), own_lm_head (lm_head.weight present, or
        required: a reduced draft vocabulary), draft_vocab_size None for a full-vocabulary
        drafter without d2t."""
        names = set(names)
        full = config.draft_vocab_size in (None, config.vocab_size)
        return dataclasses.replace(
            config, own_embedding="embed_tokens.weight" in names,
            own_lm_head="lm_head.weight" in names or not full,
            draft_vocab_size=(None if full and "d2t" not in names
                              else config.draft_vocab_size or config.vocab_size))

    @classmethod
    def check_weights(cls, folder, config, sharp=None) -> None:
        """Check a folder's tensors (names and shapes, from the file headers; a
        pytorch_model.bin is unpickled with weights_only=True) against a resolved `config`
        (as `fit_to_weights` adapts it), before any weight is read.

        Raises:
            FileNotFoundError naming the folder: no weights file.
            ValueError naming the folder, the file and the tensor: a shape that differs from the
                one config.json implies, a missing tensor, an unexpected tensor.
        """
        shapes = cls._usable(weight_index(folder)[1])
        cls._check_shapes(Path(folder), cls.fit_to_weights(config, shapes), shapes)

    @staticmethod
    def _usable(shapes: dict) -> dict:
        """`weight_index`'s {name: (file, shape)} without what no engine reads: cached RoPE
        tables, and a t2d without d2t (a full-vocabulary drafter's)."""
        shapes = {k: v for k, v in shapes.items() if not k.endswith(_SKIPPED)}
        if "d2t" not in shapes:
            shapes.pop("t2d", None)
        return shapes

    @classmethod
    def _check_shapes(cls, folder: Path, config, shapes: dict) -> None:
        """check_tensors against `expected_shapes` (t2d optional: derived from d2t)."""
        expected = cls.expected_shapes(config)
        if "t2d" not in shapes:
            expected.pop("t2d", None)
        check_tensors(folder, expected, shapes)

    @staticmethod
    def _vocab_problem(folder: Path, config, state: dict, shapes: dict) -> None:
        """Refuse a d2t that is not integer, maps outside vocab_size or twice to one target id,
        and a t2d that is not bool (naming the file and the tensor)."""
        if "d2t" in state:
            d2t, fname = state["d2t"], shapes["d2t"][0]
            if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
                raise ValueError(f"drafter checkpoint {folder}: {fname}: d2t has dtype "
                                 f"{d2t.dtype}, not an integer type")
            ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.long()
            bad = ((ids < 0) | (ids >= config.vocab_size)).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise ValueError(f"drafter checkpoint {folder}: {fname}: d2t maps draft id {i} to "
                                 f"target id {int(ids[i])} ({i} + offset {int(d2t[i])}), outside "
                                 f"vocab_size {config.vocab_size} ({bad.numel()} such id(s))")
            if ids.unique().numel() != ids.numel():
                raise ValueError(f"drafter checkpoint {folder}: {fname}: d2t maps "
                                 f"{ids.numel() - ids.unique().numel()} draft id(s) to a target "
                                 f"id another draft id already has")
        if "t2d" in state and state["t2d"].dtype != torch.bool:
            raise ValueError(f"drafter checkpoint {folder}: {shapes['t2d'][0]}: t2d has dtype "
                             f"{state['t2d'].dtype}, not bool")

    # ----- checkpoints ------------------------------------------------------------------------
    @classmethod
    def read_config(cls, folder, overrides: Optional[dict] = None) -> SpecForgeEagle3Config:
        """The config of a public EAGLE-3 folder's config.json (`from_public`), with `overrides`
        ({field of SpecForgeEagle3Config: value}, e.g. tree_topk or target_layer_ids) applied
        and validated. Succeeds without a target when the config names no aux layers
        (target_layer_ids None), so `loading.detect_kind` can tell the kind.

        Raises:
            FileNotFoundError naming the folder: not a folder, or no config.json.
            ConfigKindError: not a public EAGLE-3 config (another drafter kind).
            ValueError naming the folder, config.json and the field.
        """
        return read_public_config(folder, SpecForgeEagle3Config, overrides)

    @classmethod
    def load(cls, folder, sharp=None, device: Optional[torch.device] = None, target=None,
             overrides: Optional[dict] = None) -> "SpecForgeEagle3Drafter":
        """Build a drafter from a public EAGLE-3 folder, in the dtype of its fc.weight, on
        `device` (default CPU), in eval mode.

        Args:
            sharp: the SharpConfig (default: mode "none", n_ref = config.train_context).
            target: the target it drafts for: resolves the default aux layers when config.json
                names none, and the drafter is checked against it (`check_target`).
            overrides: {SpecForgeEagle3Config field: value} over config.json.

        Raises:
            FileNotFoundError naming the folder: not a folder, no config.json, no weights file.
            ValueError naming the folder, the file and the field or tensor: config.json invalid
                (`read_config`); no aux layers named and no target given; tensors that do not
                match config.json (checked from the headers before any weight is read); a d2t
                out of range / repeating a target id, a t2d that is not bool, a fc.weight that
                is not floating point; a target it does not fit.
        """
        folder = Path(folder)
        where = f"drafter checkpoint {folder}: {CONFIG_FILE}"
        config = cls.read_config(folder, overrides)
        if not config.resolved:
            if target is None:
                raise ValueError(f"{where} names no aux layers ({AUX_KEY} or eagle_config."
                                 f"{AUX_KEY}): pass target= to use the default (2, L // 2, "
                                 f"L - 3) of an L-layer target, or overrides="
                                 f"{{'target_layer_ids': [...]}}")
            config = config.resolve_for(target.config, where)
        _, shapes, state = weight_index(folder)
        shapes = cls._usable(shapes)
        config = cls.fit_to_weights(config, shapes)
        cls._check_shapes(folder, config, shapes)
        dev = str(device or "cpu")
        state = read_weights(folder, shapes, state, dev)
        cls._vocab_problem(folder, config, state, shapes)
        dtype = weights_dtype(folder, state, "fc.weight")
        internal = {}
        for name, v in state.items():
            if name == "d2t":      # offsets -> absolute target ids
                v = torch.arange(v.numel(), device=v.device) + v.long()
            elif v.dtype.is_floating_point:
                v = v.to(dtype)
            # a fresh (aligned) copy: the CPU kernels' results then do not depend on where the
            # file format left a tensor in memory (safetensors vs pytorch_model.bin)
            internal[_internal_name(name)] = v.clone(memory_format=torch.contiguous_format)
        internal["feature_scale"] = torch.ones(config.num_features * config.target_hidden_size,
                                               dtype=dtype, device=dev)
        with torch.device("meta"):
            model = cls(config, sharp)
        if "d2t" in internal and "t2d" not in internal:        # d2t without t2d: derive it
            internal["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool, device=dev)
            internal["t2d"][internal["d2t"]] = True
        model.load_state_dict(internal, assign=True)
        model.rotary_emb = LlamaRotaryEmbedding(config.llama_config()).to(dev)
        if target is not None:
            model.check_target(target, checkpoint=folder)
        return model.eval()

    def save(self, folder) -> None:
        """Write the public layout: config.json (`SpecForgeEagle3Config.to_public`, with dtype /
        torch_dtype set to the weights' dtype) and model.safetensors (`public_state_dict`)."""
        cfg = self.config.to_public()
        for key in ("dtype", "torch_dtype"):
            if key in cfg:
                cfg[key] = str(self.fc.weight.dtype).removeprefix("torch.")
        save_folder(folder, cfg, self.public_state_dict())


# ----- conversion and the registry hook ---------------------------------------------------------
def from_drafter(drafter: Eagle3Drafter, target) -> SpecForgeEagle3Drafter:
    """The exact public-format equivalent of one of the project's EAGLE-3 drafters for `target`:
    the same modules, feature_scale folded into fc (and fc's column blocks put in ascending layer
    order, the public feature order), lm_head = the target LM head's rows d2t (its whole weight
    for a full-vocabulary drafter), d2t / t2d from the draft vocabulary, the target's embedding
    shared (no embed_tokens). Its drafts equal the original's (up to float rounding of the fold);
    sharp, context_window, dtype and device are kept.

    Raises:
        ValueError naming the option: norm_features or feed_normed_output true (no place in the
            public architecture), target layers the public aux ids cannot name (the target's last
            layer, read after its final norm, or a repeated layer), a target LM head with a bias,
            or a drafter that does not fit `target`.
    """
    if isinstance(drafter, SpecForgeEagle3Drafter):
        drafter.check_target(target)
        return copy.deepcopy(drafter)
    c = drafter.config
    if c.norm_features:
        raise ValueError("from_drafter: norm_features is true: a per-feature RMSNorm before fc "
                         "has no place in the public EAGLE-3 architecture (fc reads the raw "
                         "target features; vLLM and SGLang have no such norm), so this drafter "
                         "has no exact public equivalent; train one with norm_features=false")
    if c.feed_normed_output:
        raise ValueError("from_drafter: feed_normed_output is true: a normalised output fed to "
                         "the next draft row has no place in the public EAGLE-3 architecture "
                         "(it feeds the layer's un-normalised output), so this drafter has no "
                         "exact public equivalent; train one with feed_normed_output=false")
    drafter.check_target(target)
    L = target.config.num_hidden_layers
    ids = list(c.target_layer_ids)
    problem = _aux_problem([i + 1 for i in ids], L)
    if problem:
        raise ValueError(f"from_drafter: target_layer_ids {ids} (aux ids {[i + 1 for i in ids]}) "
                         f"{problem}; the public format reads layer inputs only (layer "
                         f"{L - 1}'s output is hidden_states[{L}], after the final norm)")
    lm = target.get_output_embeddings()
    if getattr(lm, "bias", None) is not None:
        raise ValueError("from_drafter: the target's LM head has a bias; the public lm_head has "
                         "none")
    w = drafter.fc.weight
    vocab = lm.weight.shape[0]
    cfg = SpecForgeEagle3Config(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, target_hidden_size=c.target_hidden_size,
        target_layer_ids=sorted(ids), train_context=c.train_context,
        records_train_context=True, sharp_slopes=c.sharp_slopes,
        draft_threshold=c.draft_threshold, draft_vocab_size=c.draft_vocab_size,
        chain_length=c.chain_length,
        tree_topk=c.tree_topk, tree_depth=c.tree_depth, tree_tokens=c.tree_tokens,
        rms_norm_eps=c.rms_norm_eps, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(c.rope_parameters), vocab_size=vocab, own_lm_head=True,
        own_embedding=False)
    out = SpecForgeEagle3Drafter(cfg, drafter.sharp).to(device=w.device, dtype=w.dtype)
    ht = c.target_hidden_size
    order = sorted(range(len(ids)), key=lambda j: ids[j])        # new block j <- old order[j]
    cols = torch.cat([torch.arange(j * ht, (j + 1) * ht) for j in order]).to(w.device)
    state = {k: v for k, v in drafter.state_dict().items()
             if k not in ("feature_scale", "fc.weight", "d2t")}
    with torch.no_grad():
        fc = (w.float() * drafter.feature_scale.float()[None])[:, cols]
        state["fc.weight"] = fc.to(w.dtype)
        state["feature_scale"] = torch.ones_like(drafter.feature_scale)
        rows = lm.weight if drafter.d2t is None else lm.weight[drafter.d2t]
        state["lm_head.weight"] = rows.detach().to(device=w.device, dtype=w.dtype)
        if drafter.d2t is not None:
            state["d2t"] = drafter.d2t.clone()
            t2d = torch.zeros(vocab, dtype=torch.bool, device=w.device)
            t2d[drafter.d2t] = True
            state["t2d"] = t2d
    out.load_state_dict(state)
    out.context_window = drafter.context_window
    return out.train(drafter.training)


def untrained(target, tokenizer=None, layers: int = 1, block_size: int = 8,
              overrides: Optional[dict] = None) -> SpecForgeEagle3Drafter:
    """A random public-layout EAGLE-3 drafter for `target` (the registry's `untrained` hook:
    (target, tokenizer, layers, block_size, overrides); `layers`, `block_size` and `tokenizer`
    are ignored: the public drafter has one layer and drafts chains / trees of its config's
    shape): the target's geometry, the default aux layers (2, L // 2, L - 3) (for a target too
    shallow for three distinct ones, the distinct ids among them within 1 .. L - 1), the full
    vocabulary with the target's LM head copied into lm_head, the target's embedding shared."""
    t = target.config
    L = t.num_hidden_layers
    aux = default_aux_layers(L)
    if _aux_problem(aux, L):
        aux = sorted({min(max(a, 1), max(L - 1, 1)) for a in aux})
    lm = target.get_output_embeddings()
    cfg = SpecForgeEagle3Config(**target_geometry(t), target_hidden_size=t.hidden_size,
                                target_layer_ids=[a - 1 for a in aux],
                                vocab_size=lm.weight.shape[0], draft_vocab_size=None,
                                own_lm_head=True, own_embedding=False)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    drafter = SpecForgeEagle3Drafter(cfg)
    if cfg.draft_vocab_size is None and cfg.hidden_size == t.hidden_size:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(lm.weight)
    return drafter.eval()


__all__ = ["SpecForgeEagle3Config", "SpecForgeEagle3Drafter", "default_aux_layers",
           "from_drafter", "untrained"]
