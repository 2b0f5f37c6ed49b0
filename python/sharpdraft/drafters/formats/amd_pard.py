"""The AMD PARD format: a public PARD drafter's folder (amd/PARD-Llama-3.2-1B, PARD-Qwen2.5-0.5B,
PARD-Qwen3-0.6B, ...), its config.json translated to and from `AMDPARDConfig`, and what this format
checks beyond the shared load (`formats.public`). The drafter that runs it is
`drafters.amd_pard.AMDPARDDrafter`.

Sources (read, not copied): AMD-AIG-AIMA/PARD `pard/pard_train.py` (the training script sets
`config.pard_token` to the first id of its yaml's `unused_tokenids` and `config.spd_type =
"pard"`), `pard/pard_infer.py` (parallel drafting at inference), `config/train/example_*.yaml`
(`para_num: 8`; one repeated unused id, 151665 for Qwen, 128020 for Llama 3) and
`config/eval/*_eval.yaml` (`draft_k` 12 at inference); vllm-project/vllm
`vllm/v1/worker/gpu/spec_decode/utils.py` `get_parallel_drafting_token_id` (the mask id of a
parallel draft model: `dflash_config.mask_token_id`, then `mask_token_id`, then `pard_token`,
then `ptd_token_id`; some versions check a DSpark field before pard_token, not read here) and
docs.vllm.ai `features/speculative_decoding/parallel_draft_model` (method "draft_model" with
"parallel_drafting": the user gives num_speculative_tokens).

A public PARD checkpoint is an ordinary causal LM of its family, as transformers saves it:

    config.json   architectures ["LlamaForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM"],
                  model_type "llama" | "qwen2" | "qwen3", the family's geometry fields, plus
                  `pard_token` (one token id) and `spd_type: "pard"`
    weights       model.safetensors, shards listed by model.safetensors.index.json, or
                  pytorch_model.bin (read with torch.load(weights_only=True)), holding
                  model.embed_tokens.weight [V, H], model.layers.{i}.* (the family's decoder
                  layer: q/k/v/o projections, Qwen2's q/k/v biases, Qwen3's q/k norms, SwiGLU
                  MLP, two RMSNorms), model.norm.weight [H] and lm_head.weight [V, H] (absent
                  when tie_word_embeddings: the embedding is the LM head)

SharpDraft's extensions to config.json (read, and written by `save`), as in the other public
formats (`formats.public.read_extensions`): at the top level `train_context`
(the training context, SharpDraft's default n_ref; default 2048 when absent), `sharp_slopes`
(calibrated slopes, as `sharpdraft analyze calibrate` writes them) and `draft_threshold` (chain
drafting's measured default, in [0, 1]; 0 when absent); inference options in one
object `"sharpdraft": {"num_draft_tokens": K, "target_vocab_size": N}`: num_draft_tokens (K,
drafts per step; default 8, PARD's `para_num`; always written) and target_vocab_size (a target
vocabulary that differs from vocab_size by padding only; written only when set). Any other key
inside "sharpdraft" is refused.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Dict, Optional

from transformers import AutoConfig
from transformers.activations import ACT2FN

from ..config_checks import DEFAULT_TRAIN_CONTEXT, ConfigKindError, check_draft_threshold, is_int
from .files import CONFIG_FILE
from .public import (DRAFT_THRESHOLD_KEY, EXTRAS_KEY, PublicFormat, read_extensions, read_options,
                     write_extensions)

# model_type -> the architecture class name a public checkpoint of that family declares
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
SPD_TYPE = "pard"
DEFAULT_NUM_DRAFT_TOKENS = 8          # PARD's para_num (config/train/example_qwen.yaml)
# Where a parallel draft model may record its mask id, in vLLM's order of precedence.
TOKEN_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "pard_token", "ptd_token_id")
# keys of the "sharpdraft" object (each an AMDPARDConfig field of the same name)
DRAFTING_OPTIONS = ("num_draft_tokens", "target_vocab_size")
# SharpDraft's own keys in config.json (top level)
EXTENSION_KEYS = ("train_context", "sharp_slopes", DRAFT_THRESHOLD_KEY, EXTRAS_KEY)
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
             "vocab_size")
# config.json keys that describe the file or our kind, not the family's modules
NOT_FAMILY_KEYS = {"model_type", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
               "pard_token", "spd_type", "mask_token_id", "ptd_token_id", "dflash_config",
               "sharp_config", *EXTENSION_KEYS}


def _one_line(err: Exception) -> str:
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


def _token_fields(raw: dict) -> Dict[str, object]:
    """{key: value} of the mask-id fields present (not null) in a config dict, TOKEN_KEYS order."""
    found = {}
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict) and dflash.get("mask_token_id") is not None:
        found["dflash_config.mask_token_id"] = dflash["mask_token_id"]
    for key in TOKEN_KEYS[1:]:
        if raw.get(key) is not None:
            found[key] = raw[key]
    return found


@dataclass
class AMDPARDConfig:
    """A public PARD drafter's config.json, resolved (`from_public` reads it, `to_public`
    writes it).

    public: the config.json object without SharpDraft's extension keys (the family's fields,
    architectures, the mask-id fields, whatever else it holds, written back as read). pard_token:
    the mask token id (0 <= pard_token < vocab_size). num_draft_tokens: K, drafts per forward
    (an inference option; PARD trains with para_num 8, vLLM takes num_speculative_tokens from the
    user). train_context_length: the training context when recorded (config.json's
    `train_context`; SharpDraft's n_ref, see `train_context` and `records_train_context`).
    sharp_slopes: calibrated SharpDraft slopes. draft_threshold: chain drafting's measured
    default (config.json's `draft_threshold`; 0: every draft verified). target_vocab_size: the
    target vocabulary size this drafter is declared to serve when it differs from vocab_size by
    padding only (e.g. PARD-Qwen2.5-0.5B's 151936 rows for Qwen2.5-7B's 152064); None: vocab_size.

    Raises (in __post_init__): ValueError naming the class and the field (model_type,
    architectures, a geometry field, pard_token, num_draft_tokens, ...).
    """

    public: dict
    pard_token: int
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    train_context_length: Optional[int] = None
    sharp_slopes: Optional[list] = None
    target_vocab_size: Optional[int] = None
    draft_threshold: float = 0.0
    _family: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        name = type(self).__name__
        raw = self.public
        if not isinstance(raw, dict):
            raise ValueError(f"{name}.public must be a config.json object, got {raw!r}")
        model_type = raw.get("model_type")
        if model_type is None:
            raise ValueError(f"{name}: missing model_type (one of {', '.join(FAMILIES)})")
        if model_type not in FAMILIES:
            raise ValueError(f"{name}: model_type {model_type!r} is not supported (a PARD drafter "
                             f"of the {', '.join(FAMILIES)} families)")
        archs = raw.get("architectures")
        if archs is not None and archs != [FAMILIES[model_type]]:
            raise ValueError(f"{name}: architectures {archs!r} is not "
                             f"[{FAMILIES[model_type]!r}] (model_type {model_type!r})")
        for key in REQUIRED_FIELDS:
            if key not in raw:
                raise ValueError(f"{name}: missing {key}")
        for key in REQUIRED_FIELDS + ("num_key_value_heads", "head_dim"):
            v = raw.get(key)
            if (key in REQUIRED_FIELDS or v is not None) and (not is_int(v) or v < 1):
                raise ValueError(f"{name}: {key} must be an integer >= 1, got {json.dumps(v)}")
        kv = raw.get("num_key_value_heads") or raw["num_attention_heads"]
        if raw["num_attention_heads"] % kv:
            raise ValueError(f"{name}: num_attention_heads {raw['num_attention_heads']} is not a "
                             f"multiple of num_key_value_heads {kv} (grouped-query attention)")
        if raw.get("hidden_act", "silu") not in ACT2FN:
            raise ValueError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not an activation "
                             f"transformers knows")
        try:
            fields = copy.deepcopy({k: v for k, v in raw.items() if k not in NOT_FAMILY_KEYS})
            family = AutoConfig.for_model(model_type, **fields)   # (it edits nested dicts)
        except Exception as err:        # transformers' own validation of the family's fields
            raise ValueError(f"{name}: not a valid {model_type} config ({_one_line(err)})") \
                from None
        sliding = [i for i, t in enumerate(getattr(family, "layer_types", None) or [])
                   if t != "full_attention"]
        if sliding:
            raise ValueError(f"{name}: layer_types has non-full-attention layers {sliding} "
                             f"(use_sliding_window): sliding-window PARD layers are not supported")
        if not is_int(self.pard_token) or not 0 <= self.pard_token < family.vocab_size:
            raise ValueError(f"{name}.pard_token {self.pard_token!r} is outside the vocabulary "
                             f"(vocab_size {family.vocab_size})")
        if not is_int(self.num_draft_tokens) or self.num_draft_tokens < 1:
            raise ValueError(f"{name}.num_draft_tokens must be an integer >= 1, got "
                             f"{self.num_draft_tokens!r}")
        for f in ("train_context_length", "target_vocab_size"):
            v = getattr(self, f)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name}.{f} must be null or an integer >= 1, got {v!r}")
        if self.sharp_slopes is not None and not isinstance(self.sharp_slopes, list):
            raise ValueError(f"{name}.sharp_slopes must be null or a list, got "
                             f"{self.sharp_slopes!r}")
        check_draft_threshold(self.draft_threshold, f"{name}.draft_threshold")
        self._family = family

    # ----- what the rest of the project reads ---------------------------------------------
    def family_config(self):
        """The transformers config (LlamaConfig / Qwen2Config / Qwen3Config) of the modules,
        as transformers reads this config.json (rope_theta / rope_scaling or rope_parameters,
        defaults of absent fields); built in the default dtype, attention "sharp"."""
        return self._family

    @property
    def model_type(self) -> str:
        return self.public["model_type"]

    @property
    def architecture(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def vocab_size(self) -> int:
        return self._family.vocab_size

    @property
    def hidden_size(self) -> int:
        return self._family.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self._family.num_hidden_layers

    num_layers = num_hidden_layers

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self._family.tie_word_embeddings)

    @property
    def train_context(self) -> int:
        """SharpDraft's default n_ref: the recorded training context, else 2048."""
        return self.train_context_length or DEFAULT_TRAIN_CONTEXT

    @property
    def records_train_context(self) -> bool:
        """Whether config.json records `train_context` (else n_ref defaults to 2048; read by
        `loading.n_ref_source`)."""
        return self.train_context_length is not None

    @property
    def draft_vocab_size(self) -> None:
        """Public PARD drafters draft over their whole vocabulary."""
        return None

    # ----- config.json ----------------------------------------------------------------------
    @classmethod
    def from_public(cls, raw: dict, where: str = CONFIG_FILE) -> "AMDPARDConfig":
        """Parse a public config.json (a dict).

        A config claims to be a PARD drafter's when it has `pard_token` or `spd_type: "pard"`;
        a plain causal LM of a supported family (architectures) with another mask-id field
        (mask_token_id, dflash_config.mask_token_id, ptd_token_id, read as vLLM reads them) is
        accepted too. The mask id is read from every such field present; they must agree.

        Raises:
            ConfigKindError naming `where` and pard_token: no mask-id field at all (a plain
                causal LM: not a PARD drafter), or a mask-id field without pard_token / spd_type
                in a config whose architectures are not a plain causal LM of a supported family
                (another drafter kind, e.g. z-lab DFlash).
            ValueError naming `where` and the field: a PARD config with a missing or invalid
                field (pard_token, spd_type, model_type, architectures, the geometry, ...).
        """
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must hold a JSON object")
        tokens = _token_fields(raw)
        archs = raw.get("architectures")
        claims = "pard_token" in raw or raw.get("spd_type") == SPD_TYPE
        if not claims:
            if not tokens:
                raise ConfigKindError(
                    f"{where} has no pard_token (nor mask_token_id, dflash_config.mask_token_id, "
                    f"ptd_token_id): not a PARD drafter (a plain causal LM, or another kind; "
                    f"architectures {archs!r})")
            if not (isinstance(archs, list) and len(archs) == 1
                    and archs[0] in FAMILIES.values()):
                raise ConfigKindError(
                    f"{where} is not a public PARD config (no pard_token; architectures {archs!r} "
                    f"with {', '.join(tokens)}: another drafter kind)")
        if not tokens:
            raise ValueError(f"{where}: missing pard_token (spd_type {raw.get('spd_type')!r})")
        if raw.get("spd_type", SPD_TYPE) != SPD_TYPE:
            raise ValueError(f"{where}: spd_type is {json.dumps(raw['spd_type'])}, not "
                             f"{SPD_TYPE!r}")
        for key, value in tokens.items():
            if not is_int(value):
                raise ValueError(f"{where}: {key} must be an integer token id, got "
                                 f"{json.dumps(value)}")
        if len(set(tokens.values())) > 1:
            raise ValueError(f"{where}: the mask-id fields disagree ("
                             + ", ".join(f"{k} {v}" for k, v in tokens.items()) + ")")
        ext = read_extensions(raw, where)
        extra = dict(train_context_length=ext["train_context"], sharp_slopes=ext["sharp_slopes"],
                     draft_threshold=ext["draft_threshold"],
                     **read_options(raw, where, DRAFTING_OPTIONS, nullable=("target_vocab_size",)))
        public = {k: v for k, v in raw.items() if k not in EXTENSION_KEYS}
        try:
            return cls(public=public, pard_token=next(iter(tokens.values())), **extra)
        except ValueError as err:
            msg = str(err).replace(f"{cls.__name__}.", "").replace(f"{cls.__name__}: ", "")
            raise ValueError(f"{where}: {msg}") from None

    def to_public(self) -> dict:
        """The config.json of the public layout (what `from_public` reads back): the public
        fields, architectures, pard_token (and every other mask-id field present, set to it),
        spd_type "pard", and SharpDraft's extensions: train_context (when recorded),
        sharp_slopes (when calibrated), draft_threshold (when measured, > 0) and "sharpdraft":
        {num_draft_tokens, target_vocab_size (when set)}."""
        out = copy.deepcopy(self.public)
        out["architectures"] = [self.architecture]
        for key in _token_fields(out):
            if key == "dflash_config.mask_token_id":
                out["dflash_config"]["mask_token_id"] = self.pard_token
            else:
                out[key] = self.pard_token
        out.update(pard_token=self.pard_token, spd_type=SPD_TYPE)
        write_extensions(out, self)
        out[EXTRAS_KEY] = {k: getattr(self, k) for k in DRAFTING_OPTIONS
                           if getattr(self, k) is not None}
        return out


class AMDPARDFormat(PublicFormat):
    """What a public PARD folder holds beyond the shared layout: no lm_head.weight when
    tie_word_embeddings (the embedding is the LM head); weights in the embedding's dtype."""

    config_class = AMDPARDConfig
    dtype_tensor = "model.embed_tokens.weight"
    dtype_keys = ("torch_dtype",)            # what transformers writes

    def public_name(self, name: str) -> Optional[str]:
        return None if name == "lm_head.weight" and self.config.tie_word_embeddings else name

    @classmethod
    def unexpected_hint(cls, config, shapes: dict) -> str:
        return ("; tie_word_embeddings is true in config.json, so the embedding is the LM head"
                if config.tie_word_embeddings and "lm_head.weight" in shapes else "")
