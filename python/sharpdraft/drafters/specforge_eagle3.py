"""EAGLE-3 drafters in their public checkpoint layout (the format `formats.specforge_eagle3`:
SafeAILab/EAGLE, SpecForge), run with sharp attention, and the export of the project's own EAGLE-3
drafters to that layout.

The published EAGLE-3 drafter is the project's `Eagle3Drafter` with `norm_features=False`,
`feed_normed_output=False` and a unit `feature_scale`: g = fc(concat of raw target features),
q/k/v over [input_layernorm(embedding); hidden_norm(g)], the residual stream starting from g, the
layer's un-normalised output fed to the next draft row, logits = lm_head(norm(output)). What
differs is the checkpoint (the format module). Internally the drafter keeps the project's
conventions: `d2t` holds ABSOLUTE target ids (so `to_target_vocab` and tree drafting work
unchanged), layer tensors sit at the top level, and `target_layer_ids` use the project's numbering
(id l = output of decoder layer l = transformers' hidden_states[l + 1]).

The draft attention is causal over the drafter's own KV cache (tree rows see the committed rows
and their ancestors) through `sharpdraft_ext.sharp_attention`: the drafter's `sharp` SharpConfig
with mode "none" is the published drafter, "fixed_slope" SharpDraft (n_ref = config.train_context:
a `train_context` recorded in config.json, else 2048). RoPE is computed from positions (no table),
so a public max_position_embeddings below the target's (SafeAILab ships 2048) limits nothing; the
value is kept (it matters only to rope types that read it, e.g. "dynamic", as in the references).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..attention import SharpConfig
from .config_checks import target_geometry
from .eagle3 import Eagle3Drafter
from .formats.specforge_eagle3 import (AUX_KEY, SpecForgeEagle3Config, SpecForgeEagle3Format,
                                       aux_problem, default_aux_layers, rename)


class SpecForgeEagle3Drafter(SpecForgeEagle3Format, Eagle3Drafter):
    """A public EAGLE-3 drafter (see the module docstring): `load(folder)` reads the SafeAILab /
    SpecForge layout, `save(folder)` writes it (`formats.public.PublicFormat`), `from_drafter`
    converts one of the project's own EAGLE-3 drafters. Chain and tree drafting are
    `Eagle3Drafter`'s (its sessions call `head` and `token_embeddings`, overridden here for the
    own LM head and embedding).

    Modules beyond `Eagle3Drafter`'s: lm_head (nn.Linear H -> draft vocabulary, no bias; None
    when borrowing the target's), embed_tokens (nn.Embedding vocab x H; None when the target's
    is used), t2d (bool buffer [vocab_size], None without d2t). `d2t` holds absolute target ids.
    """

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
        problem = aux_problem(c.aux_layer_ids, t.num_hidden_layers)
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
        out = {rename(k, to_public=True): v for k, v in sd.items()}
        if "d2t" in out:
            out["d2t"] = (out["d2t"] - torch.arange(out["d2t"].numel(),
                                                    device=out["d2t"].device)).long()
        return out

    @classmethod
    def internal_state(cls, config, state: dict, dtype: torch.dtype) -> dict:
        """The module's state from the public tensors: our names, d2t offsets -> absolute target
        ids, floating tensors in `dtype`, a unit feature_scale, t2d derived from d2t when the
        folder has none."""
        internal = {}
        for name, v in state.items():
            if name == "d2t":      # offsets -> absolute target ids
                v = torch.arange(v.numel(), device=v.device) + v.long()
            elif v.dtype.is_floating_point:
                v = v.to(dtype)
            # a fresh (aligned) copy: the CPU kernels' results then do not depend on where the
            # file format left a tensor in memory (safetensors vs pytorch_model.bin)
            internal[rename(name, to_public=False)] = v.clone(
                memory_format=torch.contiguous_format)
        dev = state["fc.weight"].device
        internal["feature_scale"] = torch.ones(config.num_features * config.target_hidden_size,
                                               dtype=dtype, device=dev)
        if "d2t" in internal and "t2d" not in internal:        # d2t without t2d: derive it
            internal["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool, device=dev)
            internal["t2d"][internal["d2t"]] = True
        return internal

    def rebuild_buffers(self, device: str) -> None:
        """RoPE's frequencies (not in the state_dict) on `device`."""
        self.rotary_emb = LlamaRotaryEmbedding(self.config.llama_config()).to(device)


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
    problem = aux_problem([i + 1 for i in ids], L)
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
        chain_length=c.chain_length, context_window=c.context_window,
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
    out.attention_sinks = drafter.attention_sinks
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
    if aux_problem(aux, L):
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
