"""The SafeAILab / SpecForge EAGLE-3 format: a public EAGLE-3 drafter's folder (SafeAILab/EAGLE
`eagle/model/cnets.py` `Model`, read at cb7e084; SpecForge `specforge/modeling/draft/
llama3_eagle.py` `LlamaForCausalLMEagle3`; served by vLLM `llama_eagle3.py` and SGLang
`llama_eagle3.py`), its config.json translated to and from `SpecForgeEagle3Config`, its tensor
names, and what this format checks beyond the shared load (`formats.public`); docs/drafters.md
describes it for users. The drafter that runs it is `drafters.specforge_eagle3`.

    config.json   architectures ["LlamaForCausalLMEagle3"] (SpecForge), ["Eagle3LlamaForCausalLM"]
                  or ["Eagle3MiniMaxM2ForCausalLM"] (vLLM), or ["LlamaForCausalLM"] with a
                  draft_vocab_size key (SafeAILab's traineagle3/config.json); the Llama geometry
                  (head_dim default hidden_size / heads; rope_theta + rope_scaling or
                  rope_parameters), num_hidden_layers 1, vocab_size (the target's),
                  draft_vocab_size (default vocab_size), target_hidden_size (default
                  hidden_size), the aux layers (below), SpecForge's fc_norm (= `norm_features`)
    weights       fc.weight [H, n * H_t], midlayer.{input_layernorm,hidden_norm,
                  post_attention_layernorm}.weight [H], midlayer.self_attn.{q,k,v}_proj.weight
                  [heads * d, 2H], midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}
                  _proj.weight, norm.weight [H], lm_head.weight [draft_vocab, H] (optional only
                  for a full-vocabulary drafter, which then borrows the target's), d2t int64
                  [draft_vocab] (OFFSETS: target id = draft id + d2t[draft id]; may be absent when
                  draft_vocab_size == vocab_size), t2d bool [vocab] (optional), embed_tokens
                  .weight [vocab, H] (optional: else the target's), fc_norm.{i}.weight [H_t]

Aux layers. The public drafters read the target's residual stream at the INPUT of target layers:
aux id a = input of layer a = hidden_states[a], the project's id a - 1. Engines concatenate them in
ascending layer order, so the ids are sorted here and a repeat is refused. Read from, first match:
`eagle_aux_hidden_state_layer_ids` at the top level (aux numbering, vLLM's
`get_eagle3_aux_layers_from_config`); `eagle_config.eagle_aux_hidden_state_layer_ids` (OUTPUT
numbering: what SGLang's `set_eagle3_layers_to_capture` and SpecForge's
`resolve_eagle_capture_layers` use; vLLM's newer runners read it as aux ids, the engines disagree
by one, and this module follows SGLang / SpecForge, who write it); else the default (2, L // 2,
L - 3) of an L-layer target, resolved by `load(..., target=...)` (`read_config` still succeeds,
target_layer_ids None, for detect_kind). Both present: they must agree (top = nested + 1); `save`
writes both.

Refused variants (one-line ValueErrors naming the file and field): num_hidden_layers != 1,
tie_word_embeddings, attention / MLP / fc biases, vLLM's norm_before_residual, SpecForge's
norm_output false, eagle_config.use_aux_hidden_state false, multimodal RoPE (mrope_section).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch
from transformers.activations import ACT2FN

from ..config_checks import DEFAULT_TRAIN_CONTEXT, ConfigKindError, check_config, is_int
from ..eagle3 import Eagle3Config
from .files import CONFIG_FILE
from .public import (DRAFT_THRESHOLD_KEY, EXTRAS_KEY, ROPE_TYPES, PublicFormat, check_int_fields,
                     check_layer_fields, read_extensions, read_int, read_number, read_options,
                     read_rope, write_extensions)

ARCHITECTURE = "LlamaForCausalLMEagle3"           # what `save` writes (SpecForge's name)
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM", "Eagle3MiniMaxM2ForCausalLM")
SAFEAILAB_ARCHITECTURE = "LlamaForCausalLM"       # accepted with a draft_vocab_size key only
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
DRAFTING_OPTIONS = ("chain_length", "tree_topk", "tree_depth", "tree_tokens", "context_window")
# (prefix of our state_dict names, the public one)
_RENAMES = tuple((p, "midlayer." + p) for p in ("input_layernorm.", "hidden_norm.",
                                                 "post_attention_layernorm.", "self_attn.",
                                                 "mlp.")) + (("feature_norms.", "fc_norm."),)
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


def aux_problem(aux: List[int], num_target_layers: int) -> Optional[str]:
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
        check_int_fields(self, {"vocab_size": 2, "target_hidden_size": 1, "num_features": 1,
                                "max_position_embeddings": 1})
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
        check_layer_fields(self)
        rope = self.rope_parameters
        if not isinstance(rope, dict) or not isinstance(rope.get("rope_theta"), (int, float)):
            raise ValueError(f"{name}.rope_parameters must be an object with a numeric "
                             f"rope_theta, got {rope!r}")
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            raise ValueError(f"{name}.rope_parameters: rope_type {rope.get('rope_type')!r} is "
                             f"not one of {', '.join(ROPE_TYPES)}")
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
        problem = aux_problem(aux, L)
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
                f"{where} is not a public EAGLE-3 config (architectures {json.dumps(archs)}, "
                f"expected one of {list(ARCHITECTURES)}, or {SAFEAILAB_ARCHITECTURE!r} with a "
                f"draft_vocab_size)")

        def get_int(key, default=None, lo=1):
            return read_int(raw, key, where, default, lo)

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
                raise ValueError(f"{where}: {key} {json.dumps(raw[key])} is not supported (the "
                                 f"public EAGLE-3 layer has "
                                 + ("its own untied lm_head)" if key == "tie_word_embeddings"
                                    else "no biases)" if "bias" in key
                                    else "the residual taken before hidden_norm)"))
        if raw.get("norm_output", True) is not True:
            raise ValueError(f"{where}: norm_output {json.dumps(raw['norm_output'])} is not "
                             f"supported (logits from the un-normalised output)")
        fc_norm = raw.get("fc_norm", raw.get("use_aux_norm", False))
        if not isinstance(fc_norm, bool) and fc_norm is not None:
            raise ValueError(f"{where}: fc_norm must be true or false, got {json.dumps(fc_norm)}")
        act = raw.get("hidden_act", "silu")
        if act not in ACT2FN:
            raise ValueError(f"{where}: hidden_act {json.dumps(act)} is not an activation "
                             f"transformers knows")

        rope = read_rope(raw, where)

        # aux layers
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{where}: eagle_config must be an object, got {json.dumps(eagle)}")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError(f"{where}: eagle_config.use_aux_hidden_state "
                             f"{json.dumps(eagle['use_aux_hidden_state'])} is not supported (an "
                             f"EAGLE-3 drafter fuses aux features through fc)")

        def id_list(source, label, lo):
            ids = source.get(AUX_KEY)
            if ids is None:
                return None
            if (not isinstance(ids, list) or not ids
                    or not all(is_int(i) for i in ids)):
                raise ValueError(f"{where}: {label} must be a non-empty list of integers, got "
                                 f"{json.dumps(ids)}")
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

        extras = read_options(raw, where, DRAFTING_OPTIONS, nullable=("context_window",))
        ext = read_extensions(raw, where)
        train = ext["train_context"]
        return cls(hidden_size=hidden, intermediate_size=get_int("intermediate_size"),
                   num_attention_heads=heads,
                   num_key_value_heads=get_int("num_key_value_heads", heads),
                   head_dim=get_int("head_dim", max(1, hidden // heads)),
                   target_hidden_size=get_int("target_hidden_size", hidden),
                   target_layer_ids=layer_ids,
                   num_features=len(layer_ids) if layer_ids is not None else 3,
                   train_context=train or DEFAULT_TRAIN_CONTEXT,
                   records_train_context=train is not None, sharp_slopes=ext["sharp_slopes"],
                   draft_threshold=ext["draft_threshold"],
                   draft_vocab_size=draft_vocab, vocab_size=vocab,
                   norm_features=bool(fc_norm), feed_normed_output=False,
                   rms_norm_eps=read_number(raw, "rms_norm_eps", where, 1e-6), hidden_act=act,
                   max_position_embeddings=get_int("max_position_embeddings", 2048),
                   rope_parameters=rope, **extras,
                   extra={k: v for k, v in raw.items() if k not in _READ_KEYS},
                   eagle_extra={k: v for k, v in eagle.items() if k not in _EAGLE_READ_KEYS})

    def to_public(self) -> dict:
        """The config.json of the public layout (what `from_public` reads back): the fields of
        the module docstring (draft_vocab_size always: SGLang borrows the target's LM head when
        it is absent; the aux ids at the top level and in eagle_config) and SharpDraft's
        extensions (`formats.public.read_extensions`, "sharpdraft": the drafting options).

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
        write_extensions(out, self)
        out[EXTRAS_KEY] = {k: getattr(self, k) for k in DRAFTING_OPTIONS
                           if getattr(self, k) is not None}
        return out


def rename(name: str, to_public: bool) -> str:
    """A state_dict name of our module -> the public tensor name (`to_public`), or back: the
    layer's tensors sit under midlayer., the per-feature norms under fc_norm."""
    for ours, theirs in _RENAMES:
        old, new = (ours, theirs) if to_public else (theirs, ours)
        if name.startswith(old):
            return new + name[len(old):]
    return name


class SpecForgeEagle3Format(PublicFormat):
    """What loading a public EAGLE-3 folder does beyond the shared load: the default aux layers
    resolved from the target, the tensors no engine reads dropped, the weight-dependent config
    fields read off the tensor names, t2d optional, d2t / t2d values checked."""

    config_class = SpecForgeEagle3Config
    optional_tensors = frozenset({"t2d"})            # derived from d2t when absent

    def public_name(self, name: str) -> Optional[str]:
        """feature_scale is folded into fc.weight (`public_state_dict`); the rest: the maps."""
        return None if name == "feature_scale" else rename(name, to_public=True)

    @classmethod
    def prepare_config(cls, folder: Path, config, target):
        """The config with its aux layers resolved: from config.json, else the default of
        `target` (ValueError naming config.json when there is no target to take it from)."""
        if config.resolved:
            return config
        where = f"drafter checkpoint {folder}: {CONFIG_FILE}"
        if target is None:
            raise ValueError(f"{where} names no aux layers ({AUX_KEY} or eagle_config."
                             f"{AUX_KEY}): pass target= to use the default (2, L // 2, "
                             f"L - 3) of an L-layer target, or overrides="
                             f"{{'target_layer_ids': [...]}}")
        return config.resolve_for(target.config, where)

    @staticmethod
    def usable_shapes(shapes: dict) -> dict:
        """`weight_index`'s {name: (file, shape)} without what no engine reads: cached RoPE
        tables, and a t2d without d2t (a full-vocabulary drafter's)."""
        shapes = {k: v for k, v in shapes.items() if not k.endswith(_SKIPPED)}
        if "d2t" not in shapes:
            shapes.pop("t2d", None)
        return shapes

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
    def check_state(cls, folder: Path, config, state: dict, shapes: dict) -> None:
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
