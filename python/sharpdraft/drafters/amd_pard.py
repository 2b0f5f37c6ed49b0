"""AMD's public PARD drafters (the format `formats.amd_pard`: an ordinary causal LM of the Llama,
Qwen2 or Qwen3 family with a `pard_token`), run with sharp attention.

Unlike the project's own PARD drafter (`drafters.pard`), the drafter has its own embedding and LM
head (its hidden size need not be the target's: a 1B PARD drafts for an 8B target of the same
tokenizer), no learned mask vector (the mask rows carry the embedding row of `pard_token`), and
drafts over its whole vocabulary.

A draft step (PARDSession, shared with `drafters.pard`) embeds the committed tokens not yet in
the drafter's KV cache, ending with the last committed token at position p, followed by K - 1
copies of `pard_token` at positions p + 1 .. p + K - 1; attention is plain causal; the rows from
the last real token on give the K drafts (`logits[-K:]`); the mask rows' keys / values are then
dropped from the cache; on a quantised CPU target it runs as one op (`pard_fused`) where the
layers are Llama's. Attention runs through `sharpdraft_ext.sharp_attention` (the "sharp"
transformers attention): the drafter's `sharp` SharpConfig with mode "none" is the published
drafter, "fixed_slope" SharpDraft (n_ref: `config.train_context`).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

from ..attention import SharpConfig, register
from ..target.kv_cache import CACHE_KWARG
from .common import default_mask_token_id
from .config_checks import is_int
from .formats.amd_pard import (FAMILIES, NOT_FAMILY_KEYS, REQUIRED_FIELDS, AMDPARDConfig,
                               AMDPARDFormat)
from .formats.public import EXTRAS_KEY
from .pard import PARDDrafter


def build_family_model(config: AMDPARDConfig) -> nn.Module:
    """transformers' own causal LM of the config's family (LlamaForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM), attention through "sharp" (registered here), LM head tied to the
    embedding when tie_word_embeddings; built in the default dtype on the current device."""
    register()
    model = AutoModelForCausalLM.from_config(config.family_config(), attn_implementation="sharp")
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


class AMDPARDDrafter(AMDPARDFormat, PARDDrafter):
    """A public PARD drafter (see the module docstring): `load(folder)` reads the public layout,
    `save(folder)` writes it (`formats.public.PublicFormat`), `from_drafter` converts one of the
    project's PARD drafters.

    Submodules: `model` (transformers' LlamaModel / Qwen2Model / Qwen3Model: embed_tokens,
    layers, norm, rotary_emb) and `lm_head` (nn.Linear, tied to model.embed_tokens when
    tie_word_embeddings), so the state_dict carries the public tensor names. `sharp` (a
    SharpConfig) selects the attention scaling; default: the published drafter (mode "none"),
    n_ref = config.train_context. Inference sessions are `drafters.pard.PARDSession`.
    """

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

    @property
    def rotary_emb(self) -> nn.Module:
        """The rotary embedding (model.rotary_emb)."""
        return self.model.rotary_emb

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

    def draft_head_weight(self, target) -> torch.Tensor:
        """The own LM head's weight (what `head` applies)."""
        return self.lm_head.weight

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
    @classmethod
    def internal_state(cls, config, state: dict, dtype: torch.dtype) -> dict:
        """The public tensors in `dtype`; lm_head.weight = the embedding when tied."""
        state = {k: v.to(dtype) for k, v in state.items()}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def rebuild_buffers(self, device: str) -> None:
        """The tie (assigned weights are separate tensors) and RoPE's frequencies on `device`."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rot = self.model.rotary_emb
        self.model.rotary_emb = type(rot)(config=self.config.family_config()).to(device)

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
        out.attention_sinks = drafter.attention_sinks
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
    t = target.config
    if t.model_type not in FAMILIES:
        raise ValueError(f"amd-pard: the target's model_type {t.model_type!r} is not one of "
                         f"{', '.join(FAMILIES)}")
    vocab = target.get_input_embeddings().weight.shape[0]
    if pard_token is None:
        pard_token = default_mask_token_id(tokenizer) if tokenizer is not None else vocab - 1
    public = {k: v for k, v in t.to_diff_dict().items() if k not in NOT_FAMILY_KEYS}
    public.update({k: getattr(t, k) for k in REQUIRED_FIELDS})
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


__all__ = ["AMDPARDDrafter", "build_family_model", "untrained"]
