"""LongSpark drafter: a parallel drafter whose cost per round does not grow with the context.

Design (docs/longspark.md, after He, Liu, Shen, Li, "Efficient speculative decoding
with a fixed-cost parallel drafter"): draft layer j is paired with target layer
l(j) = target_layer_ids[j] + 1 and reads three fixed-size views of the prefix, all taken from the
target's own verification pass:

1. the boundary state c_t: the outputs of the target layers `target_layer_ids` (the inputs of
   the paired layers) at the last committed position, fused by a learned projection;
2. the recent window: the last W keys / values of target layer l(j), a view of the target's KV
   cache (nothing is copied into drafter state);
3. the global summary: R learned queries G_j per KV head attend over all t keys of target layer
   l(j); the result M_t (one value vector and one log-normaliser per query) is built once at
   prefill and then only folded with the rows each verification commits (log-sum-exp merge).

A round drafts B tokens: slot 0 holds the committed token a, slots 1 .. B - 1 a learned mask
embedding, each plus a within-block slot embedding and c_t. Each draft layer attends
bidirectionally with one softmax over [block ; window ; summary] (keys [K_block ; K_window ; G_j],
values [V_block ; V_window ; M_t]): at most B + W + R keys whatever t is. Slot i's output, through
the target's final norm and LM head, gives z_i^0, the logits of draft i + 1; a low-rank Markov
correction z_i = z_i^0 + W_c E_c(y_i) (y_0 = a, y_i = draft i) is applied while the drafts are
drawn one after another, and the corrected distributions are what verification uses (lossless).

Every attention runs through `sharpdraft_ext.sharp_attention`. The one softmax over three key
sets is computed as two kernel calls, the window read in place from the target cache and
[block ; summary], merged by log-sum-exp (exact); the summary is folded per chunk the same way.

SharpDraft has two places to act here (`LongSparkConfig.sharp_scope`, ours, measured in the
README): "summary" scales the summary queries by beta(t), the dilution of R fixed queries over
t keys (chunks are scored with the beta of the count `n_s` the summary was last rebuilt at; the
summary is rebuilt from the target cache when beta(t) has moved past `beta_tolerance`, rare since
beta grows with ln t); "slots" leaves the summary plain and gives the draft-layer rows the
n_visible override B + t (the summary slots stand for the t context tokens).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding, apply_rotary_pos_emb)

import sharpdraft_ext as ext

from ..attention import SharpConfig, attend
from .base import Drafter
from .common import evenly_spaced_layers
from .config_checks import (check_config, feature_layer_problems, llama_config,
                            require_llama_layers, target_geometry)
from .layers import HeadProjections, merge_lse
from .longspark_session import LongSparkSession

SCOPES = ("summary", "slots")
PLAIN = SharpConfig(mode="none")


@dataclass
class LongSparkConfig:
    """Geometry of a LongSpark drafter (config.json).

    hidden_size .. max_position_embeddings: the drafter's Llama geometry, the target's (its
    queries meet the target's cached keys, so heads, head_dim and RoPE must be the target's).
    target_layer_ids: target layers whose outputs form the boundary state; draft layer j reads
    the KV cache of target layer target_layer_ids[j] + 1. vocab_size: the target's vocabulary
    (the correction's embedding). num_drafts: B, slots and drafts per round. window: W.
    summary_size: R. correction_rank: rank of the Markov correction. mask_token_id: the target
    token whose embedding starts the mask slot. train_context: training context length (the
    default n_ref). sharp_scope / beta_tolerance: where SharpDraft acts (module docstring).
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
    vocab_size: int
    mask_token_id: int
    num_drafts: int = 7
    draft_threshold: float = 0.0
    window: int = 256
    summary_size: int = 16
    correction_rank: int = 32
    train_context: int = 1024
    sharp_scope: str = "summary"
    beta_tolerance: float = 0.02
    sharp_slopes: Optional[list] = None
    draft_vocab_size: Optional[int] = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                           "rope_theta": 10000.0})

    def __post_init__(self):
        check_config(self, {"num_drafts": 1, "window": 1, "summary_size": 1,
                            "correction_rank": 1, "train_context": 1, "vocab_size": 2})
        if not self.target_layer_ids:
            raise ValueError("LongSparkConfig.target_layer_ids must name at least one layer")
        if self.sharp_scope not in SCOPES:
            raise ValueError(f"LongSparkConfig.sharp_scope must be one of {SCOPES}, got "
                             f"{self.sharp_scope!r}")
        if not self.beta_tolerance >= 0:
            raise ValueError(f"LongSparkConfig.beta_tolerance must be >= 0, got "
                             f"{self.beta_tolerance}")

    @property
    def num_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def cache_layers(self) -> List[int]:
        """The target layers whose KV cache draft layers 0, 1, ... read."""
        return [i + 1 for i in self.target_layer_ids]

    @classmethod
    def from_target(cls, target_config, *, mask_token_id: int, num_layers: int = 4,
                    num_drafts: int = 7, window: int = 256, summary_size: int = 16,
                    correction_rank: int = 32, train_context: int = 1024,
                    draft_vocab_size: Optional[int] = None, **fields) -> "LongSparkConfig":
        """A drafter at the target's geometry whose `num_layers` draft layers pair with the
        target layers after `evenly_spaced_layers(L, num_layers)` (SmolLM2: layers 2, 11, 20, 29,
        boundary from the outputs of 1, 10, 19, 28: the DFlash feature cache); `fields` sets
        any other config field (sharp_scope, beta_tolerance, ...)."""
        t = target_config
        return cls(**target_geometry(t), target_hidden_size=t.hidden_size,
                   target_layer_ids=evenly_spaced_layers(t.num_hidden_layers, num_layers),
                   vocab_size=t.vocab_size, mask_token_id=int(mask_token_id),
                   num_drafts=num_drafts, window=window, summary_size=summary_size,
                   correction_rank=correction_rank, train_context=train_context,
                   draft_vocab_size=draft_vocab_size, **fields)


class LongSparkAttention(HeadProjections):
    """Slot queries over [block ; window ; summary] with one softmax (two kernel calls merged)."""

    def __init__(self, config: LongSparkConfig):
        super().__init__(config, config.hidden_size)

    def forward(self, x, rope, window_kv, window_mask, summary_k, summary_v, sharp, layer,
                n_visible):
        """x (K, B, hidden); window_kv: (k, v) (K or 1, Hk, W', d); window_mask: None or bool
        (K, 1, 1, W'); summary_k (K or 1, Hk, R, d); summary_v (K, Hk, R, d); n_visible: None,
        int or (K, 1, 1) int64 tensor, the cardinality beta uses."""
        K = x.shape[0]
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        own_k = torch.cat([k, summary_k.expand(K, -1, -1, -1).to(k.dtype)], dim=2)
        own_v = torch.cat([v, summary_v.to(v.dtype)], dim=2)
        kw = dict(n_visible=n_visible, return_lse=True)
        wk, wv = window_kv
        o_w, l_w = attend(q, wk.to(q.dtype), wv.to(q.dtype), sharp, layer=layer, module=self,
                          attn_mask=window_mask, **kw)
        o_b, l_b = attend(q, own_k, own_v, sharp, layer=layer, module=self, **kw)
        return self.out(merge_lse(o_w, l_w, o_b, l_b)[0].to(q.dtype))


class LongSparkLayer(nn.Module):
    def __init__(self, config: LongSparkConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LongSparkAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(config, config.num_layers))

    def forward(self, x, *attn_args):
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class LongSparkDrafter(Drafter):
    """The LongSpark drafter (module docstring). `sharp` selects the scaling (mode "none": the
    frozen drafter); `config.sharp_scope` where it acts."""

    config_class = LongSparkConfig
    one_softmax_per_call = False        # [block ; summary] and the window: two calls, merged

    def __init__(self, config: LongSparkConfig, sharp: Optional[SharpConfig] = None):
        super().__init__()
        self.config = c = config
        self.fuse = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size,
                              bias=False)
        self.fuse_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # per-dimension scale of the raw boundary features (training.losses.feature_scale)
        self.register_buffer("boundary_scale", torch.ones(self.fuse.in_features))
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.slot_embedding = nn.Parameter(torch.zeros(c.num_drafts, c.hidden_size))
        self.layers = nn.ModuleList(LongSparkLayer(c) for _ in range(c.num_layers))
        self.summary_queries = nn.Parameter(
            torch.randn(c.num_layers, c.num_key_value_heads, c.summary_size, c.head_dim)
            / c.head_dim ** 0.5)                                   # N(0, 1/d)
        self.correction_embedding = nn.Embedding(c.vocab_size, c.correction_rank)
        out = c.draft_vocab_size or c.vocab_size
        self.correction_out = nn.Linear(c.correction_rank, out, bias=False)
        nn.init.zeros_(self.correction_out.weight)                 # starts as no correction
        self.rotary_emb = LlamaRotaryEmbedding(llama_config(c, c.num_layers))
        self.sharp = sharp or SharpConfig(mode="none", n_ref=c.train_context)
        self._init_draft_vocab(c.draft_vocab_size)

    # ----- what the target provides --------------------------------------------------------
    @property
    def max_drafts(self) -> int:
        return self.config.num_drafts

    def boundary_features(self, hidden_states) -> torch.Tensor:
        """(B, T, n_layers * target_hidden): outputs of `target_layer_ids` (hidden_states[l + 1])."""
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def target_problems(self, target) -> List[str]:
        """The base checks, the boundary layers, paired layers that exist, and the attention
        geometry (the drafter's queries read the target's cached keys)."""
        c, t = self.config, target.config
        problems = super().target_problems(target) + feature_layer_problems(c, t)
        if any(i + 1 >= t.num_hidden_layers for i in c.target_layer_ids):
            problems.append(f"target_layer_ids {list(c.target_layer_ids)}: draft layers read the "
                            f"KV cache of layers {c.cache_layers}, the target has "
                            f"{t.num_hidden_layers} decoder layers")
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        for name, mine, theirs in (("num_key_value_heads", c.num_key_value_heads,
                                    t.num_key_value_heads), ("head_dim", c.head_dim, head_dim),
                                   ("vocab_size", c.vocab_size, t.vocab_size)):
            if mine != theirs:
                problems.append(f"{name} is {mine}, the target's is {theirs}")
        if dict(c.rope_parameters) != dict(t.rope_parameters):
            problems.append(f"rope_parameters {c.rope_parameters} differ from the target's "
                            f"{t.rope_parameters} (the drafter's queries meet its cached keys)")
        if not 0 <= c.mask_token_id < t.vocab_size:
            problems.append(f"mask_token_id is {c.mask_token_id}, outside the target's "
                            f"vocabulary of {t.vocab_size} tokens")
        return problems

    @staticmethod
    def target_kv(target, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Target layer `layer`'s keys and values (1, Hk, T, d), RoPE applied, recomputed from
        its input hidden states `hidden` (T, hidden) at `positions` (T,): what its KV cache
        holds (training, which has the cached features but not the cache)."""
        attn = target.model.layers[layer].self_attn
        x = target.model.layers[layer].input_layernorm(hidden[None])
        d = attn.head_dim
        k = attn.k_proj(x).view(1, -1, attn.k_proj.out_features // d, d).transpose(1, 2)
        v = attn.v_proj(x).view(1, -1, attn.v_proj.out_features // d, d).transpose(1, 2)
        cos, sin = target.model.rotary_emb(x, positions[None])
        return apply_rotary_pos_emb(k, k, cos, sin)[0], v

    @torch.no_grad()
    def init_from_target(self, target) -> List[int]:
        """Start from the target (returns the target layers copied): draft layer j = target
        layer l(j) (its queries then already match that layer's cached keys), the mask slot =
        the target's embedding of `mask_token_id`, and the fused boundary state scaled to the
        token embeddings' RMS (so it neither drowns nor vanishes next to them)."""
        require_llama_layers(target, "LongSpark")
        layers = target.model.layers
        for mine, idx in zip(self.layers, self.config.cache_layers):
            mine.load_state_dict(layers[idx].state_dict())
        emb = target.get_input_embeddings().weight
        self.mask_embedding.copy_(emb[self.config.mask_token_id])
        self.fuse_norm.weight.fill_(float(emb.float().pow(2).mean().sqrt()))
        return list(self.config.cache_layers)

    def sharp_variants(self) -> dict:
        """Both SharpDraft scopes (module docstring): {"summary": ..., "slots": ...}, this
        drafter and a copy differing only in `config.sharp_scope`."""
        out = {}
        for scope in SCOPES:
            if scope == self.config.sharp_scope:
                out[scope] = self
            else:
                other = copy.deepcopy(self)
                other.config = dataclasses.replace(self.config, sharp_scope=scope)
                out[scope] = other
        return out

    # ----- SharpDraft ----------------------------------------------------------------------
    def summary_sharp(self) -> SharpConfig:
        return self.sharp if self.config.sharp_scope == "summary" else PLAIN

    def slots_sharp(self) -> SharpConfig:
        return self.sharp if self.config.sharp_scope == "slots" else PLAIN

    def summary_beta(self, layer: int, n: int) -> torch.Tensor:
        """beta of the summary queries of draft layer `layer` at n keys (per head when the
        layer's slope is per head)."""
        return ext.query_scale(torch.tensor([n]), **self.summary_sharp().kernel_kwargs(layer))

    # ----- the summary ---------------------------------------------------------------------
    def summary_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: Optional[torch.Tensor] = None, n_visible=None) -> tuple:
        """The summary queries of draft layer `layer` over keys k, v (1, Hk, n, d): (out
        (1, Hk, Q, d), lse (1, Hk, Q)), Q = R (or K * R rows when attn_mask (1, 1, K * R, n)
        gives each anchor's R queries their own keys). n_visible: the count beta uses."""
        g = self.summary_queries[layer][None].to(k.dtype)
        if attn_mask is not None:
            g = g.repeat(1, 1, attn_mask.shape[-2] // g.shape[2], 1)
        return attend(g, k, v, self.summary_sharp(), layer=layer, module=self,
                      attn_mask=attn_mask, n_visible=n_visible, return_lse=True)

    # ----- the parallel pass ---------------------------------------------------------------
    def slot_logits(self, target, first_tokens: torch.Tensor, boundary: torch.Tensor,
                    positions: torch.Tensor, windows: list, window_mask, summaries: list,
                    n_visible) -> torch.Tensor:
        """z^0: (K, B, V) float32 logits of the B slots of K rounds (V: the draft vocabulary).

        Args:
            first_tokens: (K,) int64, the committed token a of each round (slot 0).
            boundary: (K, n_layers * target_hidden) boundary features (raw target outputs).
            positions: (K,) int64 absolute position of a; slot i sits at positions + i.
            windows: per draft layer, (k, v) (K or 1, Hk, W', d) window keys / values.
            window_mask: None or bool (K, 1, 1, W'), the visible window rows of each round.
            summaries: per draft layer, M (K or 1, Hk, R, d).
            n_visible: the cardinality the draft layers' beta uses (None: counted).
        """
        c = self.config
        K, B = first_tokens.shape[0], c.num_drafts
        emb = target.get_input_embeddings()
        dt = self.fuse.weight.dtype
        x = torch.cat([emb(first_tokens).to(dt)[:, None],
                       self.mask_embedding.to(dt).expand(K, B - 1, -1)], dim=1)
        ctx = self.fuse_norm(self.fuse(boundary.to(dt) * self.boundary_scale.to(dt)))
        x = x + self.slot_embedding.to(x.dtype)[None] + ctx[:, None]
        pos = positions[:, None] + torch.arange(B, device=positions.device)
        rope = self.rotary_emb(x, pos)
        sharp = self.slots_sharp()
        for j, layer in enumerate(self.layers):
            m = summaries[j]
            x = layer(x, rope, windows[j], window_mask, self.summary_queries[j][None],
                      m.expand(K, -1, -1, -1), sharp, j, n_visible)
        h = target.model.norm(x)
        return self.head(target, h)

    def correction(self, predecessors: torch.Tensor) -> torch.Tensor:
        """W_c E_c(y): (..., V) float32 logit corrections for predecessor ids (...) (target ids)."""
        return self.correction_out(self.correction_embedding(predecessors)).float()

    # ----- training forward ----------------------------------------------------------------
    def block_logits(self, target, features: torch.Tensor, ids: torch.Tensor,
                     anchors: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of K rounds of one sequence, as inference computes them.

        Round k commits a = ids[anchors[k]] at position anchors[k]: its boundary is the
        features row anchors[k] - 1, its window the target keys of positions
        [anchors[k] - W, anchors[k]), its summary all positions < anchors[k].

        Args:
            features: (T, n_layers * target_hidden) the target outputs of `target_layer_ids`
                (the inputs of the paired layers, from which their keys / values are rebuilt).
            ids: (T,) int64 token ids. anchors: (K,) int64 in [1, T - 1].
            predecessors: (K, B) int64 target ids y_i that slot i's correction reads (y_0 = a;
                teacher forcing: the true tokens ids[anchors + i]).

        Returns:
            (K, B, V) float32 corrected logits over the draft vocabulary; slot i predicts the
            token at anchors + i + 1.
        """
        c = self.config
        T = features.shape[0]
        K = anchors.shape[0]
        if anchors.dim() != 1 or int(anchors.min()) < 1 or int(anchors.max()) >= T:
            raise ValueError(f"anchors must be a (K,) tensor in [1, {T - 1}], got "
                             f"{tuple(anchors.shape)} in [{int(anchors.min())}, "
                             f"{int(anchors.max())}]")
        if predecessors.shape != (K, c.num_drafts):
            raise ValueError(f"predecessors must have shape ({K}, {c.num_drafts}), got "
                             f"{tuple(predecessors.shape)}")
        dev, H = features.device, c.target_hidden_size
        pos = torch.arange(T, device=dev)
        W = min(c.window, T)
        rows = anchors[:, None] - W + torch.arange(W, device=dev)          # (K, W)
        wmask = (rows >= 0)[:, None, None, :]
        rows = rows.clamp_min(0)
        smask = (pos[None] < anchors[:, None]).repeat_interleave(c.summary_size, 0)[None, None]
        windows, summaries = [], []
        for j, layer in enumerate(c.cache_layers):
            with torch.no_grad():
                k, v = self.target_kv(target, layer, features[:, j * H:(j + 1) * H], pos)
            windows.append((k[0][:, rows].transpose(0, 1), v[0][:, rows].transpose(0, 1)))
            m, _ = self.summary_chunk(j, k, v, attn_mask=smask)
            summaries.append(m[0].view(-1, K, c.summary_size, c.head_dim).transpose(0, 1))
        z0 = self.slot_logits(target, ids[anchors].long(), features[anchors - 1], anchors,
                              windows, wmask, summaries, self.slots_n_visible(anchors))
        return z0 + self.correction(predecessors)

    def slots_n_visible(self, anchors: torch.Tensor):
        """The draft layers' n_visible of rounds whose committed token sits at `anchors` (the
        context length t), for training and inference alike: None unless sharp_scope is
        "slots" and SharpDraft is on, else B + t."""
        if self.config.sharp_scope != "slots" or self.sharp.mode == "none":
            return None
        return (anchors + self.config.num_drafts).view(-1, 1, 1)

    # ----- inference -----------------------------------------------------------------------
    def start(self, target, prompt_ids: torch.Tensor, hidden_states,
              target_cache=None) -> "LongSparkSession":
        """A draft session after the target's prefill over `prompt_ids`; `target_cache` is the
        target runtime's KV cache (a `runtime.PreallocatedCache` or any transformers Cache whose
        layers expose keys / values (1, Hk, t, d)), read in place.

        Raises:
            ValueError: no target_cache was given.
        """
        if target_cache is None:
            raise ValueError("LongSparkDrafter.start: target_cache is required (the drafter "
                             "reads the target's KV cache)")
        return LongSparkSession(self, target, self.boundary_features(hidden_states)[:, -1],
                                target_cache)
