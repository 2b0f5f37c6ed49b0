"""EAGLE-3 drafter: one decoder layer reading the token embedding and fused target features.

Row t of the drafter holds the pair (g_t, x_{t+1}): g_t is a linear fusion (``fc``) of the
target's hidden states at position t from a low, a middle and a high layer, x_{t+1} the next
token. The layer's input concatenates RMSNorm(embedding(x_{t+1})) with RMSNorm(g_t), so its
query/key/value projections read twice the hidden width; the residual stream starts from g_t.
The output predicts x_{t+2} through the final norm and the target's LM head restricted to a
reduced draft vocabulary (`d2t`, the most frequent target tokens of the training corpus).

Drafting past the committed text: the output of row t replaces the target feature as the
hidden input of the next row (position t + 1, with the drafted token), so a chain of d drafts
costs d single-row forwards. EAGLE 3.1 options (both off by default, which is the public
EAGLE-3 architecture that vLLM and SGLang serve and `sharpdraft export` writes): an RMSNorm on
each fused feature before ``fc`` (`norm_features`), and feeding the normalised output forward
(`feed_normed_output`). Attention is causal over the drafter's own KV cache, through
`sharpdraft_ext.sharp_attention`: a chain row at position t sees n_i = t + 1 keys; a tree row
sees the committed rows plus its ancestors, passed as attn_mask, so n_i = position + 1 too.

RoPE is computed from positions on the fly (no table), so nothing is sized from the training
length: the drafter runs at any context the target runs at.

Training (`ttt_logits`, training-time test): step 0 runs the rows on the target's features;
step d >= 1 feeds every row the output of step d - 1 at the same index and the token d places
further, and lets it attend to the step-0 rows up to its index plus its own step 1 .. d rows,
exactly what the d-th draft sees at inference.
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
from .config_checks import check_config, feature_layer_problems, llama_config, target_geometry
from .eagle3_session import Eagle3Session
from .layers import HeadProjections, in_window, last_keys
from .sessions import session_cache


@dataclass
class Eagle3Config:
    """Geometry and drafting defaults of an EAGLE-3 drafter (serialised as config.json).

    target_layer_ids: the low, middle and high target layers fused into g (index l = output of
    decoder layer l). chain_length: drafts per step in chain mode. tree_topk, tree_depth,
    tree_tokens: tree drafting (children per expanded node, depth, nodes verified).
    train_context: training context length (SharpDraft's default n_ref).
    draft_threshold: chain drafting's default draft threshold (`sharpdraft.generate`),
    measured for these weights by benchmarks/draft_threshold_cpu.py (0: every draft verified).
    context_window: the default drafter context window (`Drafter.default_context_window`): the
    last W keys only, measured for these weights by benchmarks/sessions_cpu.py (None: every key).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    target_layer_ids: List[int]
    train_context: int = 1024
    sharp_slopes: Optional[list] = None   # calibrated per layer (analyze calibrate)
    draft_vocab_size: Optional[int] = None
    norm_features: bool = False
    feed_normed_output: bool = False
    chain_length: int = 5
    draft_threshold: float = 0.0
    context_window: Optional[int] = None
    tree_topk: int = 4
    tree_depth: int = 5
    tree_tokens: int = 16
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                           "rope_theta": 10000.0})

    def __post_init__(self):
        check_config(self, {"chain_length": 1, "tree_topk": 1, "tree_depth": 1,
                            "tree_tokens": 1, "train_context": 1})
        if len(self.target_layer_ids) < 1:
            raise ValueError("Eagle3Config.target_layer_ids must name at least one target layer")

    @classmethod
    def from_target(cls, target_config, target_layer_ids: Optional[List[int]] = None,
                    **kwargs) -> "Eagle3Config":
        """The target's width; fused layers default to (2, L // 2, L - 3) of L target layers."""
        t = target_config
        L = t.num_hidden_layers
        layers = list(target_layer_ids or [min(2, L - 1), L // 2, max(0, L - 3)])
        return cls(**{**target_geometry(t), "target_hidden_size": t.hidden_size,
                      "target_layer_ids": layers, **kwargs})

    def llama_config(self) -> LlamaConfig:
        """LlamaConfig of the single layer's MLP and of RoPE."""
        return llama_config(self, 1)


class Eagle3Attention(HeadProjections):
    """Self-attention whose q/k/v read the 2 * hidden input."""

    def __init__(self, config: Eagle3Config):
        super().__init__(config, 2 * config.hidden_size)

    def qkv(self, x: torch.Tensor, rope):
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        return q, k, v


class Eagle3Drafter(Drafter):
    """The EAGLE-3 drafter (see the module docstring). `sharp` selects the attention scaling
    (default: frozen, n_ref = config.train_context). `context_window` (None or W >= 1): at
    inference a chain row (context or draft) sees the W keys before it and itself, a sliding
    window (`base.window_mask` for the context rows of a call, the last W + 1 cached keys for
    a draft); a tree row the last W cached keys plus the tree rows it may see. `ttt_logits`
    applies the chain rule (exact while W >= the depth)."""

    config_class = Eagle3Config
    drafts_trees = True
    drafts_one_by_one = True
    tree_options = ("tree_topk", "tree_depth", "tree_tokens")
    supports_context_window = True

    def __init__(self, config: Eagle3Config, sharp: Optional[SharpConfig] = None):
        super().__init__()
        self.config = config
        h, ht, n = config.hidden_size, config.target_hidden_size, len(config.target_layer_ids)
        eps = config.rms_norm_eps
        self.register_buffer("feature_scale", torch.ones(n * ht), persistent=True)
        self.feature_norms = nn.ModuleList(LlamaRMSNorm(ht, eps=eps) for _ in range(n)
                                           ) if config.norm_features else None
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config.llama_config())
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        self.sharp = sharp or SharpConfig(mode="none", n_ref=config.train_context)
        self._init_draft_vocab(config.draft_vocab_size)

    # ----- pieces -------------------------------------------------------------------------------
    def context_features(self, hidden_states) -> torch.Tensor:
        """(B, T, n * target_hidden): the selected target layers' outputs, concatenated."""
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g = fc(per-feature RMSNorm(features * feature_scale)): (..., n * Ht) -> (..., H)."""
        x = features * self.feature_scale.to(features.dtype)
        if self.feature_norms is not None:
            parts = x.split(self.config.target_hidden_size, dim=-1)
            x = torch.cat([norm(p) for norm, p in zip(self.feature_norms, parts)], dim=-1)
        return self.fc(x)

    def token_embeddings(self, target) -> nn.Module:
        """The embedding table the drafter reads tokens through: the target's, shared (a
        subclass with its own table, e.g. a public checkpoint's embed_tokens, returns that)."""
        return target.get_input_embeddings()

    def _layer_in(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def _layer_out(self, hidden, attn_out):
        x = hidden + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        normed = self.norm(x)
        return normed, (normed if self.config.feed_normed_output else x)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             cache: Optional[DynamicCache], attn_mask: Optional[torch.Tensor] = None):
        """One pass of the layer over rows appended to `cache`.

        Args:
            embeds: (B, L, H) token embeddings (of x_{t+1} for row t). hidden: (B, L, H) fused
                target features g or fed-forward drafter outputs. positions: (B, L) int64.
            cache: the drafter's DynamicCache (rows appended in place) or None.
            attn_mask: None (bottom-right causal over [cache ; rows]) or bool broadcastable to
                (B, Hq, L, cached + L), True = visible.

        Returns:
            (normed output (B, L, H) for the LM head, hidden input of the next draft row).
        """
        q, k, v = self.self_attn.qkv(self._layer_in(embeds, hidden),
                                     self.rotary_emb(embeds, positions))
        if cache is not None:
            k, v = cache.update(k, v, 0)
            k, v, attn_mask = last_keys(k, v, self.context_window, q.shape[2], attn_mask,
                                        self.attention_sinks)
        o = attend(q, k, v, self.sharp, layer=0, module=self.self_attn,
                   causal=attn_mask is None and q.shape[2] > 1, attn_mask=attn_mask)
        return self._layer_out(hidden, self.self_attn.out(o))

    def draft_step(self, target, embeds: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor, cache, attn_mask: Optional[torch.Tensor] = None):
        """`step` and the draft head: (logits (B, L, draft vocab) float32, the next rows' hidden
        input (B, L, H)); same arguments as `step`. Runs the fused CPU step
        (`eagle3_fused.FusedEagle3Step`) where `prepare_for_target` built one and the call is
        one it covers, else the modules."""
        fused = self._fused()
        if fused is not None and fused.covers(self, embeds, cache):
            return fused(self, embeds, hidden, positions, cache, attn_mask)
        normed, nxt = self.step(embeds, hidden, positions, cache, attn_mask)
        return self.head(target, normed), nxt

    def prepare_for_target(self, target, quantised: bool) -> None:
        """Ready the drafter to draft for `target` (what `target.runtime.prepare_drafter`
        calls, outside any timed region): with `quantised` (a target on quantised blocks) the
        fused CPU step on Q8_0 blocks (`eagle3_fused`; none where it does not apply), else the
        modules' packed draft head. A subclass with its own `head` gives its weight in
        `draft_head_weight`."""
        from . import eagle3_fused

        self._set_fused_step(eagle3_fused.FusedEagle3Step, target, quantised)
        # the modules' head only where they draft (the fallbacks pack it on first use)
        if self._fused() is None and self.d2t is not None and type(self).head is Eagle3Drafter.head:
            self._draft_head(target.get_output_embeddings())

    def write_keys(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   cache) -> None:
        """Append rows' keys and values to `cache` without attending: what `step` stores for
        rows whose outputs nobody reads (a prompt's rows before the last). Same arguments."""
        _, k, v = self.self_attn.qkv(self._layer_in(embeds, hidden),
                                     self.rotary_emb(embeds, positions))
        cache.update(k, v, 0)

    # ----- training -----------------------------------------------------------------------------
    def ttt_logits(self, target, features: torch.Tensor, ids: torch.Tensor,
                   steps: int, positions: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Training-time test over one sequence: logits of `steps` drafting depths.

        Args:
            features: (T, n * Ht) target features at positions 0 .. T - 1 (raw; fused here).
            ids: (T,) int64 token ids of the same positions.
            steps: drafting depths simulated (>= 1).
            positions: (T,) increasing RoPE position ids of the rows (None: 0 .. T - 1); depth
                d of row t sits at positions[t] + d, as its chain draft would.
            rows: None (every row) or a sorted (R,) int64 tensor of the rows t whose drafts
                are wanted. Every row still serves as a depth-0 key; only the rows listed are
                carried through the layer's output, the deeper depths and the LM head, which
                is what a loss on a few trained rows needs (their logits equal the full
                computation's, up to float rounding).

        Returns:
            list over d = 0 .. steps - 1 of float32 logits over the draft vocabulary, one row per
            t in 0 .. T - 2 - d (rows None) or per listed t < T - 1 - d: row t of depth d
            predicts the token at position t + d + 2 (its target is the target's distribution
            at position t + d + 1).
        """
        T = ids.shape[0]
        if steps < 1 or steps > T - 1:
            raise ValueError(f"steps must lie in [1, {T - 1}], got {steps}")
        emb = self.token_embeddings(target)
        n0 = T - 1                                       # row t needs x_{t+1}
        pos = (torch.arange(n0, device=ids.device) if positions is None
               else positions[:n0].to(ids.device))[None]
        sel = (torch.arange(n0, device=ids.device) if rows is None
               else rows.to(ids.device, torch.long))
        if rows is not None and sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= n0
                                                 or bool((sel[1:] <= sel[:-1]).any())):
            raise ValueError(f"rows must be sorted distinct row indices in [0, {n0}), got "
                             f"{sel.tolist()[:8]}")
        hidden = self.fuse(features[None, :n0])
        key_ids = torch.arange(n0, device=ids.device)
        keys, values, out = [], [], []
        for d in range(steps):
            n = n0 - d                                   # rows whose token x_{t+1+d} exists
            cur = sel[sel < n]                           # a prefix of sel (sel is sorted)
            m = cur.numel()
            if d == 0:       # every row is a key; only the wanted rows query
                x = self._layer_in(emb(ids[None, 1:]), hidden)
                q, k, v = self.self_attn.qkv(x, self.rotary_emb(x, pos))
                q, h_in = (q, hidden) if rows is None else (q[:, :, cur], hidden[:, cur])
            else:            # row t's depth d - 1 output, the token d places further
                h_in = hidden[:, :m]
                x = self._layer_in(emb(ids[None, 1 + d + cur]), h_in)
                q, k, v = self.self_attn.qkv(x, self.rotary_emb(x, pos[:, cur] + d))
            keys.append(k)
            values.append(v)
            # visible: step-0 keys at index <= t, then this row's own step 1 .. d keys
            vis0 = key_ids[None, :n] <= cur[:, None]
            if self.context_window is not None:   # as chain inference: context >= t + d - W
                vis0 &= in_window(key_ids[None, :n], cur[:, None] + d - self.context_window,
                                  self.attention_sinks)
            diag = torch.eye(m, dtype=torch.bool, device=ids.device)
            mask = torch.cat([vis0] + [diag] * d, dim=1)
            kk = torch.cat([keys[0][:, :, :n]] + [kd[:, :, :m] for kd in keys[1:]], dim=2)
            vv = torch.cat([values[0][:, :, :n]] + [vd[:, :, :m] for vd in values[1:]], dim=2)
            o = attend(q, kk, vv, self.sharp, layer=0, module=self.self_attn, attn_mask=mask)
            normed, hidden = self._layer_out(h_in, self.self_attn.out(o))
            out.append(self.head(target, normed[0]))
        return out

    # ----- inference sessions (see drafters.protocol) ----------------------------------------
    def target_problems(self, target) -> List[str]:
        """The base checks and the fused target features (target_hidden_size, target_layer_ids)."""
        return super().target_problems(target) + feature_layer_problems(self.config,
                                                                        target.config)

    @property
    def max_tree_nodes(self) -> int:
        return self.config.tree_tokens

    @property
    def max_tree_depth(self) -> int:
        return self.config.tree_depth

    @property
    def max_drafts(self) -> int:
        return self.config.chain_length

    def start(self, target, prompt_ids: torch.Tensor, hidden_states,
              target_cache=None) -> "Eagle3Session":
        # a step appends at most a chain's drafts or a tree's expanded frontiers past the
        # committed rows (at a 2k-token prompt a preallocated cache took drafting from 17.5-20.1
        # to 16.3 ms a step: a DynamicCache copies its rows on every append)
        c = self.config
        cache = session_cache(target_cache, 1,
                              max(c.chain_length, max(0, c.tree_depth - 1) * c.tree_topk) + 1)
        self._refresh_fused_step(target)
        session = Eagle3Session(self, target, prompt_ids[0].tolist(),
                                self.context_features(hidden_states), cache)
        session.absorb_prompt()
        return session
