"""PARD drafter: a small causal LM of the target's family that drafts k tokens in one forward.

The drafter is the target's first `num_layers` decoder layers (own, fine-tuned copies), the
target's final norm shape and a learned mask ("pard") embedding; token embeddings and the LM
head are the target's, borrowed by reference, so a checkpoint holds only the layers, the norm,
the mask embedding and the draft vocabulary map.

Inference (one forward per step): the rows are the committed tokens not yet in the drafter's
KV cache, ending with the last committed token at position p, followed by k - 1 mask tokens at
positions p + 1 .. p + k - 1. The row of the last token predicts position p + 1, mask row j
predicts position p + j + 1, so one forward drafts k tokens. Attention is plain causal over
the cache (row i of the forward sees n_i = cache length + i + 1 keys) and runs through
`sharpdraft_ext.sharp_attention` (the "sharp" transformers attention: SharpConfig mode "none" is
the frozen drafter, "fixed_slope" SharpDraft). The mask rows' KV entries are dropped after each
step.

Training (`parallel_draft_mask`): copy 0 of a sequence is the real tokens (next-token
prediction); copy j >= 1 replaces every token with the mask, and its row at position p predicts
the token at p + 1 while seeing the real tokens at positions <= p - j and the mask rows of
copies 1 .. j - 1 at positions p - j + 1 .. p - 1, exactly the rows mask j sees at inference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from ..attention import SharpConfig, register
from ..target.kv_cache import CACHE_KWARG
from .base import Drafter
from .config_checks import check_config, llama_config, require_llama_layers, target_geometry
from .layers import in_window, window_mask
from .sessions import crop_to, draw_rows, no_drafts, session_cache, state_bytes, wanted


@dataclass
class PARDConfig:
    """Geometry of a PARD drafter (serialised as config.json).

    hidden_size .. rope_parameters: the target's Llama geometry. num_layers: decoder layers
    (started from the target's first layers). num_draft_tokens: k, drafts per forward (k - 1
    mask tokens). train_context: the training context length (SharpDraft's default n_ref).
    draft_vocab_size: size of the reduced draft vocabulary (None: the target's).
    draft_threshold: chain drafting's default draft threshold (`sharpdraft.generate`),
    measured for these weights by benchmarks/draft_threshold_cpu.py (0: every draft verified).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int = 4
    num_draft_tokens: int = 8
    draft_threshold: float = 0.0
    train_context: int = 1024
    sharp_slopes: Optional[list] = None   # calibrated per layer (analyze calibrate)
    draft_vocab_size: Optional[int] = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                           "rope_theta": 10000.0})

    def __post_init__(self):
        check_config(self, {"num_layers": 1, "num_draft_tokens": 1, "train_context": 1})

    @classmethod
    def from_target(cls, target_config, **kwargs) -> "PARDConfig":
        """The target's geometry (Llama-like config) with the given PARD options."""
        return cls(**{**target_geometry(target_config), **kwargs})

    def llama_config(self) -> LlamaConfig:
        """LlamaConfig of the layers, attention through the "sharp" interface."""
        register()
        cfg = llama_config(self, self.num_layers)
        cfg._attn_implementation = "sharp"
        return cfg


def parallel_draft_mask(keep: torch.Tensor, window: Optional[int] = None,
                        sinks: int = 0) -> torch.Tensor:
    """Training attention mask of the multi-copy parallel-drafting objective.

    Args:
        keep: (C, T) bool; keep[j, p] says whether copy j's row at position p is in the batch
            (copy 0 should keep every position; copy j's row at p needs copy j - 1's row at p - 1).
        window: None, or the context window W of inference (`PARDDrafter.context_window`): the
            row (j, p) then sees (0, q) only for q >= p - j - W or q < sinks (`window_mask`'s
            rule).

    Returns:
        (R, R) bool, True = visible, over the kept rows in copy-major order (R = keep.sum()): the
        row (j, p) sees (0, q) for q <= p - j and (i, p - j + i) for 1 <= i <= j. Its cardinality
        is therefore p + 1 (when its ancestors are kept), as at inference.
    """
    C, T = keep.shape
    dev = keep.device
    copy = torch.arange(C, device=dev)[:, None].expand(C, T)[keep]
    pos = torch.arange(T, device=dev)[None, :].expand(C, T)[keep]
    jq, pq = copy[:, None], pos[:, None]
    jk, pk = copy[None, :], pos[None, :]
    real = (jk == 0) & (pk <= pq - jq)
    if window is not None:
        real &= in_window(pk, pq - jq - window, sinks)
    ancestor = (jk >= 1) & (jk <= jq) & (pk == pq - jq + jk)
    return real | ancestor


def conditional_keep(num_copies: int, T: int, rate: float, gen: torch.Generator) -> torch.Tensor:
    """(C, T) bool rows kept by conditional token drop: copy 0 keeps all; copy j keeps row p with
    probability `rate` if copy j - 1 kept row p - 1 (so every kept row's ancestors are kept and
    copy j keeps about rate^j of its rows). Rows whose target lies past the sequence are dropped."""
    keep = torch.zeros(num_copies, T, dtype=torch.bool)
    keep[0] = True
    for j in range(1, num_copies):
        draw = torch.rand(T, generator=gen) < rate
        keep[j, j:] = keep[j - 1, j - 1:-1] & draw[j:]
    keep[:, T - 1] = False  # row p predicts token p + 1
    return keep


class PARDDrafter(Drafter):
    """The PARD drafter (see the module docstring). Build with `PARDDrafter(config)`; start it
    from a target with `init_from_target`. `sharp` selects the attention scaling (default: frozen,
    n_ref = config.train_context). `context_window` (None or W >= 1): at inference a row at
    position p sees the keys at positions >= min(p, P) - W, P the step's first draft position:
    the draft rows see the last W context keys plus the step's own rows, a context row (prefill,
    accepted tokens) a sliding window of W keys before it, so none sees nothing
    (`base.window_mask`)."""

    supports_context_window = True

    config_class = PARDConfig
    needs_hidden_states = False

    def __init__(self, config: PARDConfig, sharp: Optional[SharpConfig] = None):
        super().__init__()
        self.config = config
        llama = config.llama_config()
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, i) for i in range(config.num_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.sharp = sharp or SharpConfig(mode="none", n_ref=config.train_context)
        self._init_draft_vocab(config.draft_vocab_size)

    def init_from_target(self, target) -> List[int]:
        """Copy the target's first layers, final norm, and the mean token embedding as the mask
        embedding; returns the copied layer indices."""
        require_llama_layers(target, "PARD")
        chosen = list(range(self.config.num_layers))
        for mine, idx in zip(self.layers, chosen):
            mine.load_state_dict(target.model.layers[idx].state_dict())
        self.norm.load_state_dict(target.model.norm.state_dict())
        with torch.no_grad():
            self.mask_embedding.copy_(target.get_input_embeddings().weight.mean(0))
        return chosen

    def embed(self, target, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) ids (ignored where is_mask) -> (B, L, hidden) input embeddings."""
        e = target.get_input_embeddings()(ids.clamp_min(0))
        return torch.where(is_mask[..., None], self.mask_embedding.to(e.dtype), e)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[DynamicCache] = None) -> torch.Tensor:
        """Normed hidden states (B, L, hidden) of the rows `embeds` at `positions` (B, L).

        attn_mask: None (bottom-right causal over [cache ; rows]) or bool (B or 1, 1, L, Lk),
        True = visible.
        """
        rope = self.rotary_emb(embeds, positions)
        x = embeds
        for layer in self.layers:
            x = layer(x, attention_mask=attn_mask, position_embeddings=rope,
                      **{CACHE_KWARG: cache}, use_cache=cache is not None,
                      sharp_config=self.sharp)
        return self.norm(x)

    def train_logits(self, target, ids: torch.Tensor, keep: torch.Tensor,
                     wanted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Training forward over the kept rows of the copies of one sequence.

        Args:
            ids: (T,) int64 token ids. keep: (C, T) bool (see `conditional_keep`).
            wanted: None (every kept row) or (C, T) bool, a subset of keep: the rows whose
                logits are returned (the others still run as keys; the LM head skips them).

        Returns:
            (R, V) float32 logits over the draft vocabulary, R = wanted.sum() (default
            keep.sum()), copy-major; row (j, p) predicts the token at position p + 1.

        Raises:
            ValueError: wanted has another shape than keep or holds a row keep drops.
        """
        C, T = keep.shape
        keep = keep.to(ids.device)
        if wanted is not None:
            wanted = wanted.to(ids.device)
            if wanted.shape != keep.shape or bool((wanted & ~keep).any()):
                raise ValueError(f"wanted must be a ({C}, {T}) bool subset of keep, got shape "
                                 f"{tuple(wanted.shape)}")
        rows_ids = ids[None, :].expand(C, T)[keep]
        is_mask = (torch.arange(C, device=ids.device)[:, None].expand(C, T) > 0)[keep]
        pos = torch.arange(T, device=ids.device)[None, :].expand(C, T)[keep]
        mask = parallel_draft_mask(keep, self.context_window, self.attention_sinks)[None, None]
        h = self(self.embed(target, rows_ids[None], is_mask[None]), pos[None], attn_mask=mask)
        return self.head(target, h[0] if wanted is None else h[0, wanted[keep]])

    # ----- inference sessions (drafters.protocol) --------------------------------------------
    @property
    def max_drafts(self) -> int:
        return self.config.num_draft_tokens

    def draft_logits(self, target, embeds: torch.Tensor, positions: torch.Tensor, cache,
                     attn_mask: Optional[torch.Tensor] = None, head_from: int = 0
                     ) -> torch.Tensor:
        """Run rows `embeds` (1, L, hidden) at `positions` (1, L) through the layers, appending
        their keys and values to `cache`, and return the float32 logits (L - head_from, draft
        vocab) of rows head_from .. L - 1 (`attn_mask` as `forward`'s). Runs the fused CPU step
        (`pard_fused.FusedPARDStep`) where `prepare_for_target` built one and the call is one it
        covers, else the modules."""
        fused = self._fused()
        if fused is not None and fused.covers(self, embeds, cache):
            return fused(self, embeds, positions, cache, attn_mask, head_from)
        h = self(embeds, positions, attn_mask=attn_mask, cache=cache)
        if head_from == h.shape[1]:
            return h.new_zeros((0, 0), dtype=torch.float32)
        return self.head(target, h[0, head_from:])

    def prepare_for_target(self, target, quantised: bool) -> None:
        """Ready the drafter to draft for `target` (what `target.runtime.prepare_drafter`
        calls, outside any timed region): with `quantised` (a target on quantised blocks) the
        fused CPU step (`pard_fused`; none where it does not apply)."""
        from . import pard_fused

        self._set_fused_step(pard_fused.FusedPARDStep, target, quantised)

    def start(self, target, prompt_ids: torch.Tensor, hidden_states=None,
              target_cache=None) -> "PARDSession":
        session = PARDSession(self, target, prompt_ids[0].tolist(),
                              session_cache(target_cache, len(self.layers),
                                            self.config.num_draft_tokens + 1))
        self._refresh_fused_step(target)
        session.absorb_prompt()
        return session


class PARDSession:
    """Chain drafting state: the committed tokens and the drafter's KV cache of them."""

    def __init__(self, drafter: PARDDrafter, target, tokens: List[int], cache=None):
        self.drafter, self.target = drafter, target
        self.tokens = list(tokens)       # committed, without the pending `last`
        self.cache = DynamicCache() if cache is None else cache   # `session_cache`
        self.last = None

    @torch.no_grad()
    def absorb_prompt(self) -> None:
        """Run the drafter over the committed tokens not yet in its cache (at start: the
        prompt), so that its pass over the prompt happens with the target's prefill, as a
        serving engine does it, instead of inside the first draft step."""
        cached, n = self.cache.get_seq_length(), len(self.tokens)
        if n <= cached:
            return
        dev = self.target.get_input_embeddings().weight.device
        ids = torch.tensor([self.tokens[cached:]], device=dev)
        pos = torch.arange(cached, n, device=dev)[None]
        self.drafter.draft_logits(
            self.target, self.drafter.embed(self.target, ids, torch.zeros_like(ids, dtype=torch.bool)),
            pos, self.cache, window_mask(pos[0], n, self.drafter.context_window,
                                         self.drafter.attention_sinks), ids.shape[1])

    @torch.no_grad()
    def propose(self, last: int, position: int, draw, max_drafts=None) -> tuple:
        """k drafts (num_draft_tokens, at most max_drafts) from one forward of the uncached
        committed rows, `last` and k - 1 mask rows; max_drafts=0 drafts nothing (the rows wait
        for the next propose)."""
        if position != len(self.tokens):
            raise ValueError(f"PARD session: position {position} != committed length "
                             f"{len(self.tokens)}")
        k = wanted(self.drafter.config.num_draft_tokens, max_drafts)
        if k == 0:
            self.last = last
            return no_drafts(self.target)
        cached = self.cache.get_seq_length()
        dev = self.target.get_input_embeddings().weight.device
        real = self.tokens[cached:] + [last]
        ids = torch.tensor([real + [-1] * (k - 1)], device=dev)
        is_mask = torch.arange(ids.shape[1], device=dev)[None] >= len(real)
        pos = torch.arange(cached, cached + ids.shape[1], device=dev)[None]
        logits = self.drafter.draft_logits(
            self.target, self.drafter.embed(self.target, ids, is_mask), pos, self.cache,
            window_mask(pos[0], position, self.drafter.context_window,
                        self.drafter.attention_sinks), len(real) - 1)
        crop_to(self.cache, position + 1)      # drop the mask rows' keys/values
        self.last = last
        return draw_rows(self.drafter.to_target_vocab(self.target, logits), draw)

    def commit(self, accepted: List[int], hidden_states=None) -> None:
        self.tokens.append(self.last)
        self.tokens.extend(accepted[:-1])

    def state_bytes(self) -> int:
        return state_bytes(self.cache)
