"""DFlash drafter: a block-parallel drafter conditioned on the target's hidden states.

The drafter has no embedding or LM head of its own: it borrows the target's. Its context is the
concatenation of the target's hidden states from a few evenly spaced layers, projected to the
drafter width (linear -> RMSNorm). A draft block is the last accepted token followed by
block_size - 1 mask tokens; a few Llama-style layers run over the block, whose queries attend
non-causally to [context ; block] (every block row sees the whole context and the whole block,
so its cardinality is n_i = context + block_size). Each layer projects the context with its own
k/v projections; the drafter KV cache holds these context keys/values only (the block's are
recomputed at every step). Attention runs through `sharpdraft_ext.sharp_attention`: a
SharpConfig with mode="none" is the frozen drafter, mode="fixed_slope" is SharpDraft.

A checkpoint is a folder with config.json (DFlashConfig) and model.safetensors (the drafter's own
weights only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding, apply_rotary_pos_emb)

from ..attention import SharpConfig, attend
from .base import Drafter
from .common import evenly_spaced_layers
from .config_checks import check_config, feature_layer_problems, llama_config, target_geometry
from .layers import HeadProjections, in_window, last_keys
from .sessions import draw_rows, no_drafts, session_cache, state_bytes, wanted


@dataclass
class DFlashConfig:
    """Geometry and conventions of a DFlash drafter (serialised as config.json).

    hidden_size .. max_position_embeddings: the drafter's Llama geometry (by default the
    target's). target_hidden_size: width of each target feature. target_layer_ids: target layers
    whose outputs are concatenated into the context. block_size: b, tokens per draft block
    (1 anchor + b - 1 drafted). mask_token_id: the target-vocabulary token filling the b - 1
    draft slots. train_context: the context length the drafter was trained on (the default n_ref
    of SharpDraft). qk_norm: an RMSNorm over each head's queries and keys before RoPE (Qwen3
    style), as the public z-lab DFlash drafters have; with qk_norm and no draft vocabulary the
    drafter is exactly a public DFlash drafter (`ZLabDFlashDrafter.from_drafter`).
    draft_threshold: chain drafting's default draft threshold (`sharpdraft.generate`),
    measured for these weights by benchmarks/draft_threshold_cpu.py (0: every draft verified).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    target_layer_ids: List[int]
    mask_token_id: int
    num_layers: int = 2
    block_size: int = 16
    train_context: int = 2048
    sharp_slopes: Optional[list] = None   # calibrated per layer (analyze calibrate)
    draft_vocab_size: Optional[int] = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                           "rope_theta": 10000.0})
    qk_norm: bool = False
    draft_threshold: float = 0.0

    def __post_init__(self):
        check_config(self, {"block_size": 2, "num_layers": 1, "train_context": 1})

    @classmethod
    def from_target(cls, target_config, *, mask_token_id: int, num_layers: int = 2,
                    block_size: int = 16, num_features: int = 4,
                    train_context: int = 2048,
                    draft_vocab_size: Optional[int] = None,
                    qk_norm: bool = False) -> "DFlashConfig":
        """A drafter at the target's width, reading `num_features` evenly spaced target layers.

        Args:
            target_config: the target's transformers config (Llama-like: hidden_size,
                num_attention_heads, num_key_value_heads, intermediate_size, rope_parameters).
            mask_token_id: a token id of the target's vocabulary (see `default_mask_token_id`).
        """
        t = target_config
        return cls(**target_geometry(t), target_hidden_size=t.hidden_size,
                   target_layer_ids=evenly_spaced_layers(t.num_hidden_layers, num_features),
                   mask_token_id=int(mask_token_id), num_layers=num_layers,
                   block_size=block_size, train_context=train_context,
                   draft_vocab_size=draft_vocab_size, qk_norm=qk_norm)

    def llama_config(self) -> LlamaConfig:
        """The transformers LlamaConfig the drafter's layers (MLP, norms, RoPE) are built from."""
        return llama_config(self, self.num_layers)


class DFlashAttention(HeadProjections):
    """Block queries over [context ; block] keys, non-causal, through sharp attention."""

    def __init__(self, config: DFlashConfig):
        super().__init__(config, config.hidden_size)
        if config.qk_norm:
            self.q_norm = LlamaRMSNorm(config.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(config.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def context_kv(self, ctx, ctx_rope) -> tuple:
        """Keys and values of the context rows (B, Hk, Tn, d): the context is keys only."""
        kc = self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads))
        vc = self._heads(self.v_proj(ctx), self.num_kv_heads)
        return apply_rotary_pos_emb(kc, kc, *ctx_rope)[0], vc

    def forward(self, x, ctx, block_rope, ctx_rope, cache: Optional[DynamicCache], layer: int,
                sharp: SharpConfig, attn_mask: Optional[torch.Tensor],
                window: Optional[int] = None, sinks: int = 0):
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads))
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, *block_rope)
        kc, vc = self.context_kv(ctx, ctx_rope)
        if cache is not None:  # context keys/values only: the block is recomputed every step
            kc, vc = cache.update(kc, vc, layer)
        if attn_mask is None:  # inference: optionally the last `window` context keys only
            kc, vc, _ = last_keys(kc, vc, window, sinks=sinks)
        k, v = torch.cat([kc, k], dim=2), torch.cat([vc, v], dim=2)
        out = attend(q, k, v, sharp, layer=layer, module=self, attn_mask=attn_mask)
        return self.out(out)


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        llama = config.llama_config()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def forward(self, x, ctx, block_rope, ctx_rope, cache, layer, sharp, attn_mask,
                window=None, sinks=0):
        x = x + self.self_attn(self.input_layernorm(x), ctx, block_rope, ctx_rope, cache, layer,
                               sharp, attn_mask, window, sinks)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(Drafter):
    """The DFlash drafter (see the module docstring). Build it with `DFlashDrafter(config)`.

    `sharp` (a SharpConfig) selects the attention scaling at inference; its default is the
    frozen drafter (mode "none") with n_ref = config.train_context. `context_window` (None or
    W >= 1): at inference the block attends to the last W context positions only.
    """

    supports_context_window = True
    # Online adaptation (`eval.adapt.OnlineAdapter`) can fine-tune it while it decodes: its
    # training forward `block_logits(target, feats, block, anchors)` takes teacher-forced
    # blocks of [anchor ; mask tokens] over the context features its sessions see.
    adapts_online = True

    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig, sharp: Optional[SharpConfig] = None):
        super().__init__()
        self.config = config
        n_feat = len(config.target_layer_ids)
        self.fc = nn.Linear(n_feat * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        self.sharp = sharp or SharpConfig(mode="none", n_ref=config.train_context)
        self._init_draft_vocab(config.draft_vocab_size)

    # ----- context ------------------------------------------------------------------------
    def context_features(self, hidden_states) -> torch.Tensor:
        """Concatenate the target's selected layer outputs: (B, T, n_features * target_hidden).

        Args:
            hidden_states: the tuple a transformers forward returns with output_hidden_states
                (embeddings first, so layer l's output is hidden_states[l + 1]).
        """
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    # ----- forward --------------------------------------------------------------------------
    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                context_features: torch.Tensor, context_positions: torch.Tensor,
                cache: Optional[DynamicCache] = None,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the drafter layers over a block; returns normed hidden states (B, Lb, hidden).

        Args:
            block_embeds: (B, Lb, hidden), the target's embeddings of the block tokens.
            block_positions: (B, Lb) int64 absolute positions of the block rows (RoPE).
            context_features: (B, Tn, n_features * target_hidden), the new context features (those
                not yet in `cache`; may be Tn = 0 when the cache already holds them all).
            context_positions: (B, Tn) int64 absolute positions of those features.
            cache: drafter KV cache of context keys/values (DynamicCache), appended in place;
                None to attend to `context_features` alone (training).
            attn_mask: None (every row sees every key) or bool, broadcastable to
                (B, Hq, Lb, Tctx + Lb) over [context ; block], True = visible.
        """
        ctx = self.hidden_norm(self.fc(context_features))
        block_rope = self.rotary_emb(block_embeds, block_positions)
        ctx_rope = self.rotary_emb(ctx, context_positions)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, block_rope, ctx_rope, cache, i, self.sharp, attn_mask,
                      self.context_window, self.attention_sinks)
        return self.norm(x)

    def write_context(self, context_features: torch.Tensor, context_positions: torch.Tensor,
                      cache) -> None:
        """Append the context rows' keys and values to `cache` (every layer) without running a
        block: what `forward` stores for them. Shapes as in `forward`."""
        ctx = self.hidden_norm(self.fc(context_features))
        ctx_rope = self.rotary_emb(ctx, context_positions)
        for i, layer in enumerate(self.layers):
            cache.update(*layer.self_attn.context_kv(ctx, ctx_rope), i)

    def block_logits(self, target, context_features: torch.Tensor, block_ids: torch.Tensor,
                     anchors: torch.Tensor,
                     positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Training forward: logits of many draft blocks over one sequence's context, no cache.

        Block k sits at positions anchors[k] .. anchors[k] + b - 1 and sees the context features
        of positions < anchors[k] (the last `context_window` of them when it is set) plus its
        own whole block (n_i = anchors[k] + b, as at inference). Row j of block k predicts the token at position anchors[k] + j (j >= 1).

        Args:
            target: the target model (its input embeddings and LM head are borrowed).
            context_features: (T, n_features * target_hidden) for positions 0 .. T - 1.
            block_ids: (K, b) int64 token ids: column 0 the anchor token ids[anchors[k]], the
                others `config.mask_token_id`.
            anchors: (K,) int64 anchor positions, each in [1, T].
            positions: (T,) int64 increasing RoPE positions of the context rows (None: 0 .. T - 1);
                block k's rows then sit at positions[anchors[k]] + j (needs anchors < T).
                Position-robust training passes ids that skip forward, so that the relative
                distances seen reach beyond T while the number of keys stays T.

        Returns:
            logits (K, b, V), float32, over the draft vocabulary (V = config.draft_vocab_size;
            `d2t` maps column ids to target ids), or the target vocabulary when it has none.
        """
        K, b = block_ids.shape
        T = context_features.shape[0]
        if anchors.shape != (K,):
            raise ValueError(f"anchors must have shape ({K},), got {tuple(anchors.shape)}")
        if int(anchors.min()) < 1 or int(anchors.max()) > T:
            raise ValueError(f"anchors must lie in [1, {T}] (context length), got "
                             f"[{int(anchors.min())}, {int(anchors.max())}]")
        dev = context_features.device
        offs = torch.arange(b, device=dev)
        ctx_pos = torch.arange(T, device=dev) if positions is None else positions.to(dev)
        if positions is not None:
            if positions.shape != (T,):
                raise ValueError(f"positions must have shape ({T},), got {tuple(positions.shape)}")
            if int(anchors.max()) >= T:
                raise ValueError(f"with positions, anchors must lie in [1, {T - 1}]")
        start = anchors if positions is None else ctx_pos[anchors]
        block_pos = (start[:, None] + offs).reshape(1, K * b)
        cols = torch.arange(T, device=dev)[None, :]
        sees_ctx = cols < anchors[:, None]                                          # (K, T)
        if self.context_window is not None:          # as at inference: the last W positions
            sees_ctx &= in_window(cols, anchors[:, None] - self.context_window,
                                  self.attention_sinks)
        same_block = torch.eye(K, dtype=torch.bool, device=dev)
        mask = torch.cat([sees_ctx.repeat_interleave(b, 0),
                          same_block.repeat_interleave(b, 0).repeat_interleave(b, 1)], dim=1)
        embeds = target.get_input_embeddings()(block_ids.reshape(1, K * b))
        h = self(embeds, block_pos, context_features[None], ctx_pos[None], attn_mask=mask)
        return self.head(target, h).view(K, b, -1)

    @torch.no_grad()
    def draft_logits(self, target, last_token: int, position: int,
                     new_context: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Inference step: logits of the b - 1 drafted tokens after `last_token`.

        Args:
            target: the target model (embeddings and LM head borrowed).
            last_token: the last committed token id, at absolute position `position`.
            new_context: (1, Tn, n_features * target_hidden) features of the committed positions
                position - Tn .. position - 1 not yet in `cache` (appended to it).
            cache: the drafter's DynamicCache (context keys only).

        Returns:
            float32 logits (b - 1, target vocab); row j - 1 predicts the token at position + j.
            With a draft vocabulary, tokens outside it get -inf (probability 0 in the draft).
            Runs the fused CPU step (`dflash_fused.FusedDFlashStep`) where `prepare_for_target`
            built one and the call is one it covers, else the modules.
        """
        b = self.config.block_size
        dev = new_context.device
        ids = torch.full((1, b), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = last_token
        pos = torch.arange(position, position + b, device=dev)[None]
        tn = new_context.shape[1]
        ctx_pos = torch.arange(position - tn, position, device=dev)[None]
        embeds = target.get_input_embeddings()(ids)
        fused = self._fused()
        if fused is not None and fused.covers(self, embeds, new_context, cache):
            logits = fused(self, embeds, pos, new_context, ctx_pos, cache)
        else:
            h = self(embeds, pos, new_context, ctx_pos, cache=cache)
            logits = self.head(target, h[0, 1:])
        return self.to_target_vocab(target, logits)

    # ----- inference sessions (drafters.protocol) --------------------------------------------
    def target_problems(self, target) -> List[str]:
        """The base checks, the target features read (target_hidden_size, target_layer_ids)
        and the mask token (an id of the target's vocabulary)."""
        problems = super().target_problems(target) + feature_layer_problems(self.config,
                                                                            target.config)
        vocab = target.get_input_embeddings().weight.shape[0]
        if not 0 <= self.config.mask_token_id < vocab:
            problems.append(f"mask_token_id is {self.config.mask_token_id}, outside the "
                            f"target's vocabulary of {vocab} tokens")
        return problems

    @property
    def max_drafts(self) -> int:
        return self.config.block_size - 1

    def prepare_for_target(self, target, quantised: bool) -> None:
        """Ready the drafter to draft for `target` (what `target.runtime.prepare_drafter`
        calls, outside any timed region): with `quantised` (a target on quantised blocks) the
        fused CPU step (`dflash_fused`; none where it does not apply)."""
        from . import dflash_fused

        self._set_fused_step(dflash_fused.FusedDFlashStep, target, quantised)

    def start(self, target, prompt_ids: torch.Tensor, hidden_states,
              target_cache=None) -> "DFlashSession":
        """A draft session after the target's prefill forward over `prompt_ids`."""
        self._refresh_fused_step(target)
        session = DFlashSession(self, target, self.context_features(hidden_states),
                                session_cache(target_cache, self.config.num_layers,
                                              self.config.block_size))
        session.absorb_prompt()
        return session


class DFlashSession:
    """Chain drafting state: the drafter KV cache and the context features not yet in it."""

    def __init__(self, drafter: DFlashDrafter, target, new_context: torch.Tensor, cache=None):
        self.drafter, self.target = drafter, target
        self.cache = DynamicCache() if cache is None else cache   # `session_cache`
        self.new_context = new_context

    @torch.no_grad()
    def absorb_prompt(self) -> None:
        """Store the prompt's context keys and values now (`write_context`), with the target's
        prefill, as a serving engine does it, instead of inside the first draft step."""
        tn = self.new_context.shape[1]
        if tn:
            pos = torch.arange(tn, device=self.new_context.device)[None]
            self.drafter.write_context(self.new_context, pos, self.cache)
            self.new_context = self.new_context[:, :0]

    def propose(self, last: int, position: int, draw, max_drafts=None) -> tuple:
        """The block's b - 1 drafts (the first max_drafts of them; the block always runs
        whole, its rows see each other); max_drafts=0 drafts nothing (the new context waits for
        the next propose)."""
        n = wanted(self.drafter.config.block_size - 1, max_drafts)
        if n == 0:
            return no_drafts(self.target)
        logits = self.drafter.draft_logits(self.target, last, position, self.new_context,
                                           self.cache)
        self.new_context = self.new_context[:, :0]
        return draw_rows(logits[:n], draw)

    def commit(self, accepted: List[int], hidden_states) -> None:
        feats = self.drafter.context_features(hidden_states)
        self.new_context = torch.cat([self.new_context, feats[:, :len(accepted)]], dim=1)

    def state_bytes(self) -> int:
        return state_bytes(self.cache, self.new_context)
