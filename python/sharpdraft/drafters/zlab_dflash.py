"""z-lab DFlash drafters (the public format `formats.zlab_dflash`), run with sharp attention.

The public DFlash drafters differ from the project's own DFlash drafter (`drafters.dflash`): q/k
RMSNorms per head (Qwen3 style), no draft vocabulary (logits over the whole target vocabulary
through the target's LM head), optional sliding-window layers, and a Hugging Face style
config.json (`formats.zlab_dflash.ZLabDFlashConfig`); `ZLabDFlashDrafter.load(folder)` reads such
a folder as it is published (the shared load of `formats.public`), `save(folder)` writes it.

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
from typing import List, Optional

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from ..attention import SharpConfig, attend
from .base import Drafter
from .common import default_mask_token_id
from .config_checks import feature_layer_problems
from .formats.zlab_dflash import ZLabDFlashConfig, ZLabDFlashFormat, build_target_layer_ids
from .sessions import draw_rows, no_drafts, state_bytes, wanted


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


class ZLabDFlashDrafter(ZLabDFlashFormat, Drafter):
    """A public z-lab DFlash drafter (see the module docstring): `load(folder)` reads the public
    layout, `save(folder)` writes it (`formats.public.PublicFormat`). `sharp` (a SharpConfig)
    selects the attention scaling; its default is the published drafter (mode "none") with
    n_ref = config.train_context."""

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
        public.rebuild_buffers(str(drafter.fc.weight.device))
        return public.to(dtype).eval()

    # ----- checkpoints ------------------------------------------------------------------------
    def rebuild_buffers(self, device: str) -> None:
        """RoPE's frequencies (not in the state_dict) on `device`."""
        self.rotary_emb = Qwen3RotaryEmbedding(self.config.qwen3_config()).to(device)


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

    def propose(self, last: int, position: int, draw, max_drafts=None) -> tuple:
        """The block's drafts (the first max_drafts; the block always runs whole);
        max_drafts=0 drafts nothing."""
        if position != self.length:
            raise ValueError(f"propose: position {position} is not the number of committed "
                             f"context positions ({self.length})")
        n = wanted(self.drafter.config.block_size - 1, max_drafts)
        if n == 0:
            return no_drafts(self.target)
        logits = self.drafter.draft_logits(self.target, last, position, self.cache)
        return draw_rows(logits[:n], draw)

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


__all__ = ["ZLabDFlashDrafter", "ZLabDFlashSession", "untrained"]
