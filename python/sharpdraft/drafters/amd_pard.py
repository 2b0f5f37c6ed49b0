"""AMD's public PARD drafters (amd/PARD-Llama-3.2-1B, PARD-Qwen2.5-0.5B, PARD-Qwen3-0.6B, ...) in
their published layout, run with sharp attention.

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

Unlike the project's own PARD drafter (`drafters.pard`), the drafter has its own embedding and LM
head (its hidden size need not be the target's: a 1B PARD drafts for an 8B target of the same
tokenizer), no learned mask vector (the mask rows carry the embedding row of `pard_token`), and
drafts over its whole vocabulary.

A draft step (PARDSession, shared with `drafters.pard`) embeds the committed tokens not yet in
the drafter's KV cache, ending with the last committed token at position p, followed by K - 1
copies of `pard_token` at positions p + 1 .. p + K - 1; attention is plain causal; the rows from
the last real token on give the K drafts (`logits[-K:]`); the mask rows' keys / values are then
dropped from the cache. Attention runs through `sharpdraft_ext.sharp_attention` (the "sharp"
transformers attention): the drafter's `sharp` SharpConfig with mode "none" is the published
drafter, "fixed_slope" SharpDraft (n_ref: `config.train_context`).

SharpDraft's extensions to config.json (read, and written by `save`), as in the other public
adapters (`drafters.zlab_dflash`, `drafters.specforge_eagle3`): at the top level `train_context`
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
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.activations import ACT2FN

from ..attention import SharpConfig, register
from ..target.kv_cache import CACHE_KWARG
from .base import CONFIG_FILE, DEFAULT_TRAIN_CONTEXT, ConfigKindError, check_draft_threshold
from .pard import PARDDrafter, PARDSession
from .public_files import (DRAFT_THRESHOLD_KEY, check_tensors, is_int, read_draft_threshold,
                           read_public_config, read_weights, save_folder, weight_index,
                           weights_dtype)

# model_type -> the architecture class name a public checkpoint of that family declares
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
SPD_TYPE = "pard"
DEFAULT_NUM_DRAFT_TOKENS = 8          # PARD's para_num (config/train/example_qwen.yaml)
# Where a parallel draft model may record its mask id, in vLLM's order of precedence.
TOKEN_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "pard_token", "ptd_token_id")
EXTRAS_KEY = "sharpdraft"                         # our drafting options in config.json
# keys of the "sharpdraft" object (each an AMDPARDConfig field of the same name)
DRAFTING_OPTIONS = ("num_draft_tokens", "target_vocab_size")
# SharpDraft's own keys in config.json (top level)
EXTENSION_KEYS = ("train_context", "sharp_slopes", DRAFT_THRESHOLD_KEY, EXTRAS_KEY)
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
             "vocab_size")
# config.json keys that describe the file or our kind, not the family's modules
_NOT_FAMILY = {"model_type", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
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
        for key in _REQUIRED:
            if key not in raw:
                raise ValueError(f"{name}: missing {key}")
        for key in _REQUIRED + ("num_key_value_heads", "head_dim"):
            v = raw.get(key)
            if (key in _REQUIRED or v is not None) and (not is_int(v) or v < 1):
                raise ValueError(f"{name}: {key} must be an integer >= 1, got {json.dumps(v)}")
        kv = raw.get("num_key_value_heads") or raw["num_attention_heads"]
        if raw["num_attention_heads"] % kv:
            raise ValueError(f"{name}: num_attention_heads {raw['num_attention_heads']} is not a "
                             f"multiple of num_key_value_heads {kv} (grouped-query attention)")
        if raw.get("hidden_act", "silu") not in ACT2FN:
            raise ValueError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not an activation "
                             f"transformers knows")
        try:
            fields = copy.deepcopy({k: v for k, v in raw.items() if k not in _NOT_FAMILY})
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
        extra = {}
        train = raw.get("train_context")
        if train is not None and (not is_int(train) or train < 1):
            raise ValueError(f"{where}: train_context must be an integer >= 1, got "
                             f"{json.dumps(train)}")
        extra["train_context_length"] = train
        slopes = raw.get("sharp_slopes")
        if slopes is not None and not isinstance(slopes, list):
            raise ValueError(f"{where}: sharp_slopes must be a list, got {json.dumps(slopes)}")
        extra["sharp_slopes"] = slopes
        extra["draft_threshold"] = read_draft_threshold(raw, where)
        options = raw.get(EXTRAS_KEY)
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ValueError(f"{where}: {EXTRAS_KEY} must be an object of "
                             f"{', '.join(DRAFTING_OPTIONS)}, got {json.dumps(options)}")
        unknown = [k for k in options if k not in DRAFTING_OPTIONS]
        if unknown:
            raise ValueError(f"{where}: {EXTRAS_KEY} has unknown key(s) "
                             f"{', '.join(f'{EXTRAS_KEY}.{k}' for k in unknown)} (known: "
                             f"{', '.join(DRAFTING_OPTIONS)})")
        for key, v in options.items():
            if v is None and key == "target_vocab_size":
                continue
            if not is_int(v) or v < 1:
                raise ValueError(f"{where}: {EXTRAS_KEY}.{key} must be an integer >= 1, got "
                                 f"{json.dumps(v)}")
            extra[key] = v
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
        if self.records_train_context:
            out["train_context"] = self.train_context_length
        if self.sharp_slopes is not None:
            out["sharp_slopes"] = self.sharp_slopes
        if self.draft_threshold:
            out[DRAFT_THRESHOLD_KEY] = self.draft_threshold
        out[EXTRAS_KEY] = {k: getattr(self, k) for k in DRAFTING_OPTIONS
                           if getattr(self, k) is not None}
        return out


def build_family_model(config: AMDPARDConfig) -> nn.Module:
    """transformers' own causal LM of the config's family (LlamaForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM), attention through "sharp" (registered here), LM head tied to the
    embedding when tie_word_embeddings; built in the default dtype on the current device."""
    register()
    model = AutoModelForCausalLM.from_config(config.family_config(), attn_implementation="sharp")
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


class AMDPARDDrafter(PARDDrafter):
    """A public PARD drafter (see the module docstring): `load(folder)` reads the public layout,
    `save(folder)` writes it, `from_drafter` converts one of the project's PARD drafters.

    Submodules: `model` (transformers' LlamaModel / Qwen2Model / Qwen3Model: embed_tokens,
    layers, norm, rotary_emb) and `lm_head` (nn.Linear, tied to model.embed_tokens when
    tie_word_embeddings), so the state_dict carries the public tensor names. `sharp` (a
    SharpConfig) selects the attention scaling; default: the published drafter (mode "none"),
    n_ref = config.train_context. Inference sessions are `drafters.pard.PARDSession`.
    """

    config_class = AMDPARDConfig

    def __init__(self, config: AMDPARDConfig, sharp: Optional[SharpConfig] = None):
        nn.Module.__init__(self)        # not PARDDrafter's: no Llama layers, no mask vector
        self.config = config
        lm = build_family_model(config)
        self.model, self.lm_head = lm.model, lm.lm_head
        self.sharp = sharp or SharpConfig(mode="none", n_ref=config.train_context)
        self._init_draft_vocab(None)

    # ----- forward pieces ---------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (model.layers)."""
        return self.model.layers

    @property
    def norm(self) -> nn.Module:
        """The final RMSNorm (model.norm)."""
        return self.model.norm

    def embed(self, target, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) ids (ignored where is_mask) -> (B, L, hidden) embeddings, the mask rows taking
        the embedding row of pard_token (the drafter's own embedding; `target` is unused)."""
        ids = torch.where(is_mask, torch.full_like(ids, self.config.pard_token), ids)
        return self.model.embed_tokens(ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[DynamicCache] = None) -> torch.Tensor:
        """Normed hidden states (B, L, hidden) of the rows `embeds` at `positions` (B, L), through
        the family's decoder layers with sharp attention.

        attn_mask: None (bottom-right causal over [cache ; rows]) or bool (B or 1, 1, L, Lk),
        True = visible.
        """
        rope = self.model.rotary_emb(embeds, positions)
        x = embeds
        for layer in self.model.layers:
            x = layer(x, attention_mask=attn_mask, position_embeddings=rope,
                      **{CACHE_KWARG: cache}, use_cache=cache is not None,
                      sharp_config=self.sharp)
        return self.model.norm(x)

    def head(self, target, h: torch.Tensor) -> torch.Tensor:
        """float32 logits (.., vocab_size) of normed hidden states through the drafter's own LM
        head (`target` is unused)."""
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()

    def to_target_vocab(self, target, logits: torch.Tensor) -> torch.Tensor:
        """(n, vocab_size) -> (n, target vocab): unchanged when the sizes agree; padded with -inf
        (probability 0) or cut to the target's rows when they differ (a target vocabulary padded
        otherwise, `target_vocab_size`; `check_target` refuses any other difference)."""
        vocab = target.get_output_embeddings().weight.shape[0]
        if logits.shape[-1] == vocab:
            return logits
        if logits.shape[-1] > vocab:
            return logits[..., :vocab]
        full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
        full[..., :logits.shape[-1]] = logits
        return full

    def init_from_target(self, target) -> List[int]:
        """Copy a target of the same family and geometry into the drafter: its embedding, its
        first num_hidden_layers decoder layers, its final norm and its LM head (an early-exit
        model, what `untrained` starts from); returns the copied layer indices.

        Raises:
            RuntimeError (torch): a shape that differs from the target's.
        """
        chosen = list(range(self.config.num_hidden_layers))
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            for mine, idx in zip(self.model.layers, chosen):
                mine.load_state_dict(target.model.layers[idx].state_dict())
            self.model.norm.load_state_dict(target.model.norm.state_dict())
            if not self.config.tie_word_embeddings:
                self.lm_head.weight.copy_(target.get_output_embeddings().weight)
        return chosen

    # ----- sessions ---------------------------------------------------------------------------
    def start(self, target, prompt_ids: torch.Tensor, hidden_states=None,
              target_cache=None) -> PARDSession:
        session = PARDSession(self, target, prompt_ids[0].tolist())
        session.absorb_prompt()
        return session

    # ----- fitting a target -----------------------------------------------------------------
    def target_problems(self, target) -> List[str]:
        """The vocabulary: the target's (its LM head's rows) must be vocab_size, or
        target_vocab_size when set (a vocabulary padded otherwise). The hidden size may differ
        (the drafter has its own embedding and LM head)."""
        c = self.config
        vocab = target.get_output_embeddings().weight.shape[0]
        if c.target_vocab_size is not None:
            if vocab != c.target_vocab_size:
                return [(f"{EXTRAS_KEY}.target_vocab_size is {c.target_vocab_size}, the "
                         f"target's vocabulary has {vocab} tokens")]
            return []
        if vocab != c.vocab_size:
            return [(f"vocab_size is {c.vocab_size}, the target's vocabulary has {vocab} "
                     f"tokens (a PARD drafter for another vocabulary; if only the padding "
                     f"differs, pass overrides={{'target_vocab_size': {vocab}}})")]
        return []

    # ----- checkpoints ------------------------------------------------------------------------
    def public_state(self) -> Dict[str, torch.Tensor]:
        """{public tensor name: tensor} (lm_head.weight left out when tied)."""
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def save(self, folder) -> None:
        """Write the public layout: config.json (`AMDPARDConfig.to_public`, dtype / torch_dtype
        set to the weights' dtype) and model.safetensors (the public tensor names)."""
        cfg = self.config.to_public()
        dtype = str(self.model.embed_tokens.weight.dtype).removeprefix("torch.")
        keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
        for key in keys:
            cfg[key] = dtype
        save_folder(folder, cfg, self.public_state())

    @classmethod
    def read_config(cls, folder, overrides: Optional[dict] = None) -> AMDPARDConfig:
        """The config of a public PARD folder's config.json, with `overrides` ({AMDPARDConfig
        field: value}, e.g. num_draft_tokens, train_context_length, target_vocab_size) applied
        and validated.

        Raises:
            FileNotFoundError naming the folder: not a folder, or no config.json.
            ConfigKindError: not a PARD config (see `AMDPARDConfig.from_public`).
            ValueError naming the folder, config.json and the field.
        """
        return read_public_config(folder, AMDPARDConfig, overrides)

    @classmethod
    def expected_shapes(cls, config: AMDPARDConfig) -> Dict[str, tuple]:
        """{tensor name: shape} of the public layout for `config` (built on the meta device;
        no lm_head.weight when tie_word_embeddings)."""
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in cls(config).public_state().items()}

    @classmethod
    def check_weights(cls, folder, config, sharp=None) -> None:
        """Check a folder's tensors (names and shapes, from the file headers; a pytorch_model.bin
        is unpickled with weights_only=True to see them) against `config`.

        Raises:
            FileNotFoundError naming the folder: no weights file.
            ValueError naming the folder, the file and the tensor: a missing, misshapen or
                unexpected tensor.
        """
        cls._check_shapes(Path(folder), config, weight_index(folder)[1])

    @classmethod
    def _check_shapes(cls, folder: Path, config: AMDPARDConfig, shapes: dict) -> None:
        hint = ("; tie_word_embeddings is true in config.json, so the embedding is the LM head"
                if config.tie_word_embeddings and "lm_head.weight" in shapes else "")
        check_tensors(folder, cls.expected_shapes(config), shapes, hint)

    @classmethod
    def load(cls, folder, sharp=None, device: Optional[torch.device] = None, target=None,
             overrides: Optional[dict] = None) -> "AMDPARDDrafter":
        """Build a drafter from a public PARD folder, in the dtype of its
        model.embed_tokens.weight, on `device` (default CPU), in eval mode.

        Args:
            sharp: the SharpConfig (default: mode "none", n_ref = config.train_context).
            target: when given, the drafter is checked against it (`check_target`).
            overrides: {AMDPARDConfig field: value} over config.json (e.g. num_draft_tokens).

        Raises:
            FileNotFoundError naming the folder: not a folder, no config.json, no weights file.
            ConfigKindError: config.json is not a PARD drafter's.
            ValueError naming the folder, the file and the field or tensor: config.json not
                JSON or invalid (`read_config`), tensors that do not match it (checked before
                any weight is read into the model), non-floating weights, or a target whose
                vocabulary differs.
        """
        folder = Path(folder)
        config = cls.read_config(folder, overrides)
        _, shapes, state = weight_index(folder)
        cls._check_shapes(folder, config, shapes)
        dev = str(device or "cpu")
        state = read_weights(folder, shapes, state, dev)
        dtype = weights_dtype(folder, state, "model.embed_tokens.weight")
        state = {k: v.to(dtype) for k, v in state.items()}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        with torch.device("meta"):
            model = cls(config, sharp)
        model.load_state_dict(state, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        rot = model.model.rotary_emb
        model.model.rotary_emb = type(rot)(config=config.family_config()).to(dev)
        if target is not None:
            model.check_target(target, checkpoint=folder)
        return model.eval()

    # ----- from the project's own PARD drafter -----------------------------------------------
    @classmethod
    def from_drafter(cls, drafter: PARDDrafter, target, pard_token: Optional[int] = None,
                     tokenizer=None) -> "AMDPARDDrafter":
        """The public-format equivalent of one of the project's PARD drafters (Llama layers): a
        LlamaForCausalLM whose layers and final norm are the drafter's, whose embedding is the
        target's with row `pard_token` replaced by the drafter's mask_embedding, and whose LM
        head is the target's (untied, since one embedding row changed); drafts over the full
        vocabulary. K, train_context, sharp_slopes, draft_threshold, `sharp` and
        `context_window` are carried over; the weights take the dtype of the drafter's norm.
        Its drafts equal the drafter's as long as `pard_token` never occurs as a real token
        (choose an unused id, as PARD does: a reserved or padding id). `pard_token` None: the
        tokenizer's mask token (`common.default_mask_token_id`), so that `drafters.export` can
        call it with (drafter, target, tokenizer=...).

        Raises:
            ValueError naming draft_vocab_size: the drafter drafts over a reduced vocabulary
                (the public format cannot express it: drafts would differ).
            ValueError naming pard_token: not an id of the target's vocabulary, or neither it
                nor a tokenizer given.
            ValueError naming hidden_size: the drafter's width is not the target embedding's.
            ValueError naming lm_head: the target's LM head has a bias (LlamaForCausalLM's has
                none).
        """
        c = drafter.config
        if pard_token is None:
            if tokenizer is None:
                raise ValueError("from_drafter: pard_token is needed (or a tokenizer to take its "
                                 "mask token from)")
            from .common import default_mask_token_id
            pard_token = default_mask_token_id(tokenizer)
        if c.draft_vocab_size is not None or drafter.d2t is not None:
            raise ValueError(f"from_drafter: the drafter's draft_vocab_size is "
                             f"{c.draft_vocab_size} (a reduced draft vocabulary); a public PARD "
                             f"drafts over the full vocabulary, so its drafts would differ")
        emb = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        vocab = emb.shape[0]
        if not is_int(pard_token) or not 0 <= pard_token < vocab:
            raise ValueError(f"from_drafter: pard_token {pard_token!r} is outside the target's "
                             f"vocabulary of {vocab} tokens")
        if emb.shape[1] != c.hidden_size or head.weight.shape != (vocab, c.hidden_size):
            raise ValueError(f"from_drafter: the drafter's hidden_size is {c.hidden_size}, the "
                             f"target's embedding / LM head are {tuple(emb.shape)} / "
                             f"{tuple(head.weight.shape)}")
        if getattr(head, "bias", None) is not None:
            raise ValueError("from_drafter: the target's lm_head has a bias, which a "
                             "LlamaForCausalLM LM head cannot hold")
        rope = dict(c.rope_parameters)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        t = target.config
        public = {"architectures": [FAMILIES["llama"]], "model_type": "llama",
                  "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                  "num_attention_heads": c.num_attention_heads,
                  "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                  "num_hidden_layers": c.num_layers, "vocab_size": vocab,
                  "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act,
                  "max_position_embeddings": c.max_position_embeddings,
                  "rope_theta": rope["rope_theta"],
                  "rope_scaling": None if scaling.get("rope_type", "default") == "default"
                  and len(scaling) <= 1 else scaling,
                  "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(t, key, None) is not None:
                public[key] = getattr(t, key)
        config = AMDPARDConfig(public=public, pard_token=int(pard_token),
                               num_draft_tokens=c.num_draft_tokens,
                               train_context_length=c.train_context,
                               sharp_slopes=c.sharp_slopes,
                               draft_threshold=c.draft_threshold)
        dtype = drafter.norm.weight.dtype
        out = cls(config, drafter.sharp).to(device=emb.device, dtype=dtype)
        with torch.no_grad():
            table = emb.detach().to(dtype).clone()
            table[pard_token] = drafter.mask_embedding.detach().to(dtype)
            out.model.embed_tokens.weight.copy_(table)
            out.lm_head.weight.copy_(head.weight.detach().to(dtype))
            for mine, theirs in zip(out.model.layers, drafter.layers):
                mine.load_state_dict(theirs.state_dict())
            out.model.norm.load_state_dict(drafter.norm.state_dict())
        out.context_window = drafter.context_window
        return out.eval()


def untrained(target, tokenizer=None, layers: int = 2, block_size: int = 9,
              overrides: Optional[dict] = None, pard_token: Optional[int] = None
              ) -> AMDPARDDrafter:
    """A public-layout PARD drafter for `target` (the registry's `untrained` hook: (target,
    tokenizer, layers, block_size, overrides)): a causal LM of the target's family and geometry
    with `layers` decoder layers, started from the target's embedding, first layers, final norm
    and LM head (`init_from_target`), K = block_size - 1, the pard token from the tokenizer
    (`common.default_mask_token_id`) or `pard_token` (default: the last id).

    Raises:
        ValueError: the target's model_type is not llama, qwen2 or qwen3, or an override is
            invalid.
    """
    from .common import default_mask_token_id
    t = target.config
    if t.model_type not in FAMILIES:
        raise ValueError(f"amd-pard: the target's model_type {t.model_type!r} is not one of "
                         f"{', '.join(FAMILIES)}")
    vocab = target.get_input_embeddings().weight.shape[0]
    if pard_token is None:
        pard_token = default_mask_token_id(tokenizer) if tokenizer is not None else vocab - 1
    public = {k: v for k, v in t.to_diff_dict().items() if k not in _NOT_FAMILY}
    public.update({k: getattr(t, k) for k in _REQUIRED})
    public.update(model_type=t.model_type, architectures=[FAMILIES[t.model_type]],
                  num_hidden_layers=layers, vocab_size=vocab)
    if isinstance(public.get("layer_types"), list):
        public["layer_types"] = public["layer_types"][:layers]
    cfg = AMDPARDConfig(public=public, pard_token=int(pard_token),
                        num_draft_tokens=block_size - 1)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    drafter = AMDPARDDrafter(cfg)
    drafter.init_from_target(target)
    return drafter.eval()


__all__ = ["FAMILIES", "AMDPARDConfig", "AMDPARDDrafter", "build_family_model", "untrained"]
