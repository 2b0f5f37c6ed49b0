"""Speculative decoding (batch size 1) with any drafter, and the target-only baseline.

One chain step: the drafter proposes up to `max_drafts` tokens after the last committed token;
the target runs once over [last token ; drafts] on top of its KV cache; the longest accepted
prefix plus one token from the target (the correction at the first rejection, or the bonus token
after a fully accepted block) is committed, and the target cache is cropped back past the first
rejection. Tree steps (`tree_speculative_generate`, EAGLE-3) verify a whole draft tree in one
forward with a tree mask and commit its longest accepted path.

- temperature 0: a draft is accepted iff it equals the target's argmax, so the output is
  token-identical to target-only greedy decoding.
- temperature > 0: speculative sampling. Draft j is drawn from the drafter's q_j and accepted
  with probability min(1, p_j(x) / q_j(x)); at the first rejection the token is drawn from the
  residual norm(max(0, p_j - q_j)). The committed tokens are distributed exactly as the target's
  own samples (p = softmax(logits / temperature)).

Draft length (`policy.py`): the "fixed" policy asks for `max_drafts` and verifies every
proposed draft, or with draft_threshold > 0 cuts the drafts before the first one whose drafter
probability (of the drafted token, at temperature 1) falls below the threshold, keeping at least
one; a drafter that drafts one token a forward (`Drafter.drafts_one_by_one`: EAGLE-3) also stops
drafting there. The "auto" policy chooses, each step, between drafting (cut by the drafter's
measured threshold, else by the expected rate) and a target-only step, from the measured costs
and acceptance of the request (and of earlier ones of the same drafter and target). Either choice depends only on the drafter and past timings, so decoding stays
lossless, and verifying fewer tokens makes a verification forward cheaper where its cost grows
with its length (CPUs).

Statistics: tau (acceptance length) is the mean number of tokens committed per verification
forward, the target's token included, so 1 <= tau <= max_drafts + 1 (tree: depth + 1). The
prefill forward (which commits the first token) is counted in `target_forwards` but not in tau.
Times: the prefill (the target's prompt forward, the drafter session's start with whatever pass
over the prompt it makes, and the first token) is timed apart from the decode that follows,
and the decode's drafting and verification apart from each other (spec §7: speedup and
decode speedup).

Every loop runs the target through one `sharpdraft.target.TargetRuntime` (preallocated KV
cache, the sharp kernel with mode "none", logits and hidden states only where used, prepacked
linear layers), sized for prompt + max_new_tokens + the largest draft and refused, before any
work, when that exceeds the target's max_position_embeddings, with Python's cyclic garbage
collector paused (`gc_paused`).

`target`, in every loop (and in `decode.generate`, `batched.generate_batch`): a transformers
causal LM, or a `TargetRuntime` prepared from one (`TargetRuntime.prepare(model, plan)`: choose
the plan, e.g. a measured one saved to a file). A bare model is never changed: the loops run it
through a runtime prepared with the "auto" plan (no timing), kept per model for later calls
(`runtime_session`). A runtime serves one generation at a time: two threads that share a bare
model each get their own; two that share one runtime get RuntimeError (`runtime.BUSY`) in the
second.
"""
from __future__ import annotations

import functools
import gc
import inspect
import itertools
import math
import threading
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from ..target.logits import RowLogits
from ..target.quantized import is_quantised
from ..target.runtime import TargetRuntime, prepare_drafter
from .policy import make_policy, resolve
from .sampling import probabilities, sample_next


@dataclass
class GenerationResult:
    """Tokens and statistics of one generation.

    tokens: the new token ids (EOS included when it ended the run). target_forwards: target
    forwards, the prefill included. accept_lengths: tokens committed by each verification forward.
    context_lengths: the committed length before each verification. draft_lengths: drafts
    verified by each verification forward. wall_s: wall time of the whole generation (prefill
    included). prefill_s: the prompt forward and the first token. draft_s / verify_s: seconds
    spent drafting / in target verification forwards (with their acceptance) after the prefill.
    """

    tokens: List[int]
    prompt_tokens: int
    target_forwards: int
    wall_s: float
    block_size: int = 1
    accept_lengths: List[int] = field(default_factory=list)
    context_lengths: List[int] = field(default_factory=list)
    draft_lengths: List[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy: Dict[str, object] = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification forward (bonus included); 1.0 for plain AR."""
        if not self.accept_lengths:
            return 1.0
        return sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens / wall_s (prefill included)."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def decode_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second of decoding (1 / TPOT; prefill excluded)."""
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")

    @property
    def steps(self) -> int:
        """Decode forwards after the prefill (verifications; AR: one per token)."""
        return self.target_forwards - 1

    def _per_step_ms(self, seconds: float) -> float:
        return 1e3 * seconds / self.steps if self.steps else float("nan")

    def acceptance_by_position(self) -> List[float]:
        """Entry j - 1: the fraction of verification steps that accepted at least j drafts.

        These add up to tau - 1 (tokens committed beyond the target's own token).
        """
        n = len(self.accept_lengths)
        return [sum(a - 1 >= j for a in self.accept_lengths) / n if n else 0.0
                for j in range(1, self.block_size)]

    def tau_by_context(self, bucket: int = 1024) -> Dict[str, float]:
        """tau per bucket of committed context length ("0-1023", "1024-2047", ...)."""
        groups = defaultdict(list)
        for a, c in zip(self.accept_lengths, self.context_lengths):
            lo = c // bucket * bucket
            groups[lo].append(a)
        return {f"{lo}-{lo + bucket - 1}": sum(v) / len(v) for lo, v in sorted(groups.items())}

    def summary(self) -> dict:
        """JSON-ready statistics (no text); undefined rates (NaN) are None."""
        out = {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "target_forwards": self.target_forwards, "tau": self.tau,
                "acceptance_by_position": self.acceptance_by_position(),
                "tau_by_context": self.tau_by_context(),
                "mean_draft_length": (sum(self.draft_lengths) / len(self.draft_lengths)
                                      if self.draft_lengths else 0.0),
                "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s,
                "prefill_s": self.prefill_s,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "draft_ms_per_step": self._per_step_ms(self.draft_s),
                "verify_ms_per_step": self._per_step_ms(self.verify_s),
                "draft_policy": self.policy.get("policy"),
                "drafted_share": self.policy.get("drafted_share"),
                "policy_estimates": self.policy or None}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in out.items()}


def seq_rep(tokens: Sequence[int], n: int = 4) -> float:
    """seq-rep-n of a generated sequence (Welleck et al. 2019, "Neural Text Generation with
    Unlikelihood Training"): the share of its n-grams that repeat an earlier one, 1 - unique /
    total; 0 with fewer than n tokens. Near 0 for ordinary text, towards 1 in a loop (the
    easiest text to draft, so a bench reports it next to tau)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    """One token from a (V,) logits row: `sampling.sample_next` without a nucleus."""
    return int(sample_next(logits, temperature, generator=generator))


# Runtimes the loops prepared for bare models: {model: (its tensors' fingerprint, [runtimes])}.
# Weak keys: the runtimes hold no reference to the model (they share its tensors only), so an
# entry goes with its model.
_RUNTIMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_RUNTIMES_LOCK = threading.Lock()


def _fingerprint(model) -> tuple:
    """What a cached runtime depends on: the identity, storage, dtype and device of every
    parameter and buffer (a module or tensor replaced, `model.to(...)`, loading a checkpoint
    into new tensors change it; in-place updates reach the runtime's shared tensors anyway)."""
    return tuple((id(t), t.data_ptr(), t.dtype, t.device)
                 for t in itertools.chain(model.parameters(), model.buffers()))


def target_model(target):
    """The transformers model of `target` (a model, or a `TargetRuntime`'s prepared copy): what
    config checks and drafters read."""
    return target.model if isinstance(target, TargetRuntime) else target


@contextmanager
def runtime_session(target, capacity: int, hidden_layers: Iterable[int] = ()):
    """A started `TargetRuntime` for one generation over `target`, finished when the block
    ends (exceptions included).

    Args:
        target: a `TargetRuntime` (its `session`), or a transformers causal LM: then a runtime
            prepared from it with the "auto" plan (no timing) and kept for the model's later
            calls while its tensors stay the same (`_fingerprint`), a fresh one when every kept
            one is in a generation (another thread's, or an outer one of this thread). The
            model itself is never changed.
        capacity: cache positions.
        hidden_layers: hidden-state indices the forwards return.

    Raises:
        RuntimeError(`runtime.BUSY`): a `TargetRuntime` that is in another generation.
        ValueError: a hidden-layer index outside [0, num_layers].
    """
    if isinstance(target, TargetRuntime):
        with target.session(capacity, hidden_layers=hidden_layers) as runtime:
            yield runtime
        return
    stamp = _fingerprint(target)
    runtime = None
    with _RUNTIMES_LOCK:
        entry = _RUNTIMES.get(target)
        if entry is not None and entry[0] == stamp:
            runtime = next((rt for rt in entry[1] if not rt.busy), None)
            if runtime is not None:        # claimed under the lock: no other thread gets it
                runtime.start(capacity, hidden_layers=hidden_layers)
    if runtime is None:                    # prepared outside the lock (it takes a while)
        runtime = TargetRuntime.prepare(target)
        runtime.start(capacity, hidden_layers=hidden_layers)
        with _RUNTIMES_LOCK:
            entry = _RUNTIMES.get(target)
            if entry is None or entry[0] != stamp:
                entry = _RUNTIMES[target] = (stamp, [])
            entry[1].append(runtime)
    try:
        yield runtime
    finally:
        runtime.finish()


def check_context(target, prompt_tokens: int, max_new_tokens: int, extra: int = 0,
                  what: str = "prompt", flag: str = "max_new_tokens") -> int:
    """Refuse a generation whose prompt + max_new_tokens exceed the target's context (its
    config's max_position_embeddings; no limit when the config has none): past it, RoPE
    positions were never trained and decoding degrades. The one context check of the engine,
    the CLI and the analyses.

    Args:
        target: a transformers causal LM or a `TargetRuntime` (only the config is read).
        prompt_tokens: tokens of the prompt (`what` names it in the message, e.g. "prompt
            kjv-2048" or "--length").
        max_new_tokens: tokens to generate (`flag` names it: "max_new_tokens" for a Python
            caller, "--max-new-tokens" or "--steps" for the command line).
        extra: rows a verification may add past the committed tokens (drafts); they count
            toward the cache capacity, not toward the limit.

    Returns:
        int: the KV-cache capacity the generation needs, prompt_tokens + max_new_tokens + extra.

    Raises:
        ValueError naming `flag`, the positions needed and the limit, with a value of `flag`
            that fits (or, when even the prompt alone fills the context, asking to shorten it).
    """
    limit = getattr(target_model(target).config, "max_position_embeddings", None)
    needed = prompt_tokens + max_new_tokens
    if limit is not None and needed > limit:
        def named(value):
            return f"{flag} {value}" if flag.startswith("-") else f"{flag}={value}"
        if max_new_tokens == 0:
            raise ValueError(f"{what}: {prompt_tokens} tokens exceed the target's context of "
                             f"{limit} positions (max_position_embeddings)")
        room = limit - prompt_tokens
        hint = f"use {named(room)} or less" if room >= 1 else f"shorten the {what}"
        raise ValueError(f"{named(max_new_tokens)}: the {what} ({prompt_tokens} tokens) plus "
                         f"{max_new_tokens} new tokens need {needed} positions, more than the "
                         f"target's context of {limit} (max_position_embeddings); {hint}")
    return needed + extra


def _check(target, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float,
           extra: int = 0) -> int:
    """Validate the common arguments; returns the cache capacity the generation needs
    (prompt + max_new_tokens + `extra` rows a verification may add beyond the committed ones).

    Raises:
        ValueError naming the argument: prompt_ids not (1, L >= 1), max_new_tokens < 1, a
            negative or non-finite temperature, or a context too long (`check_context`).
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must have shape (1, L) with L >= 1 (batch size 1), got "
                         f"{tuple(prompt_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    return check_context(target, prompt_ids.shape[1], max_new_tokens, extra)


def gc_paused(fn):
    """`fn` run with Python's cyclic garbage collector paused, its state restored afterwards
    (reference counting still frees every object that is not in a cycle). A collection walks
    every tracked object of the process, hundreds of thousands once a model and its tokenizer
    are loaded, and the decode loop's small allocations set one off every few steps: paused,
    target-only decoding of SmolLM2-135M on its Q4_1 blocks went from 85-87 to 95-98 tok/s
    (2-core Xeon, two interleaved runs each). The decoding loops here and
    `batched.generate_batch` are wrapped."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return run


class _Progress:
    """Optional progress callback: called with the number of newly committed tokens."""

    def __init__(self, callback):
        self.callback = callback

    def __call__(self, n: int):
        if self.callback is not None:
            self.callback(n)


@gc_paused
@torch.no_grad()
def autoregressive_generate(target, prompt_ids: torch.Tensor, max_new_tokens: int, *,
                            temperature: float = 0.0, eos_token_id: Optional[int] = None,
                            generator: Optional[torch.Generator] = None,
                            progress=None) -> GenerationResult:
    """Target-only decoding, one token per forward (the baseline), on the same
    `TargetRuntime` as the speculative loops.

    Args:
        target: a transformers causal LM (left as it is: it runs through a runtime of its
            own, see the module docstring) or a `TargetRuntime` (`TargetRuntime.prepare`).
        prompt_ids: (1, L) int64 token ids.
        max_new_tokens: stop after this many tokens (>= 1).
        temperature: 0 = greedy, else sampling from softmax(logits / temperature).
        eos_token_id: stop after committing this token.
        generator: torch.Generator for sampling.
        progress: optional callable(n) told of every n newly committed tokens.

    Raises:
        ValueError: prompt_ids not (1, L), max_new_tokens < 1, temperature negative or not
            finite, or prompt + max_new_tokens beyond the target's max_position_embeddings.
        RuntimeError(`runtime.BUSY`): a `TargetRuntime` in another generation.
    """
    capacity = _check(target, prompt_ids, max_new_tokens, temperature)
    with runtime_session(target, capacity) as runtime:
        return _ar_loop(runtime, prompt_ids, max_new_tokens, temperature, eos_token_id,
                        generator, progress)[0]


def _ar_loop(runtime, prompt_ids, max_new_tokens, temperature, eos_token_id, generator,
             progress, follow_up=None, max_context=None) -> List[GenerationResult]:
    """`autoregressive_generate`'s loop on a started runtime, one result per turn (a single one
    without `follow_up`; `autoregressive_chat`)."""
    tick = _Progress(progress)
    start = time.perf_counter()
    logits = runtime.forward(prompt_ids, last_only=True).logits[-1]
    results: List[GenerationResult] = []
    while True:
        tokens: List[int] = []
        result = GenerationResult(tokens, runtime.length, 1, 0.0)
        results.append(result)
        while True:
            tok = _pick(logits, temperature, generator)
            tokens.append(tok)
            if len(tokens) == 1:
                result.prefill_s = time.perf_counter() - start
            tick(1)
            if tok == eos_token_id or len(tokens) >= max_new_tokens:
                break
            ids = torch.tensor([[tok]], device=prompt_ids.device)
            logits = runtime.forward(ids).logits[-1]
            result.target_forwards += 1
        result.wall_s = time.perf_counter() - start
        result.verify_s = result.wall_s - result.prefill_s
        turn = _next_turn(follow_up, results, runtime, max_new_tokens, max_context)
        if turn is None:
            return results
        start = time.perf_counter()
        ids = torch.cat([torch.tensor([[tokens[-1]]]), turn], dim=1).to(prompt_ids.device)
        logits = runtime.forward(ids, last_only=True).logits[-1]


def _next_turn(follow_up, results: List[GenerationResult], runtime, max_new_tokens: int,
               max_context: Optional[int]) -> Optional[torch.Tensor]:
    """The ids `follow_up` appends after the last turn's answer (checked), or None: no
    follow_up, or it ends the session."""
    if follow_up is None:
        return None
    i = len(results) - 1
    turn = follow_up(i, list(results[-1].tokens))
    if turn is None:
        return None
    if (not isinstance(turn, torch.Tensor) or turn.dim() != 2 or turn.shape[0] != 1
            or turn.shape[1] < 1 or turn.is_floating_point()):
        raise ValueError(f"follow_up: after turn {i}: expected (1, L) int64 token ids, L >= 1, "
                         f"got {getattr(turn, 'shape', type(turn).__name__)}")
    needed = runtime.length + 1 + turn.shape[1] + max_new_tokens
    if needed > max_context:
        raise ValueError(f"follow_up: after turn {i}: {runtime.length + 1} positions, "
                         f"{turn.shape[1]} more and max_new_tokens {max_new_tokens} need "
                         f"{needed} > max_context {max_context}; end the session before")
    return turn.long()


def _chat_capacity(target, prompt_ids, max_new_tokens, temperature,
                   max_context: Optional[int]) -> int:
    """max_context (default: the target's max_position_embeddings), checked, for a session."""
    limit = getattr(target_model(target).config, "max_position_embeddings", None)
    max_context = max_context if max_context is not None else limit
    if max_context is None:
        raise ValueError("max_context: the target's config has no max_position_embeddings; "
                         "give the session's largest context")
    if limit is not None and max_context > limit:
        raise ValueError(f"max_context: {max_context} > the target's max_position_embeddings "
                         f"{limit}")
    _check(target, prompt_ids, max_new_tokens, temperature)
    if prompt_ids.shape[1] + max_new_tokens > max_context:
        raise ValueError(f"max_context: the prompt ({prompt_ids.shape[1]} tokens) and "
                         f"max_new_tokens {max_new_tokens} exceed it ({max_context})")
    return max_context


@gc_paused
@torch.no_grad()
def autoregressive_chat(target, prompt_ids: torch.Tensor, max_new_tokens: int, follow_up, *,
                        temperature: float = 0.0, eos_token_id: Optional[int] = None,
                        generator: Optional[torch.Generator] = None, progress=None,
                        max_context: Optional[int] = None) -> List[GenerationResult]:
    """Target-only decoding of a multi-turn session: the KV cache is kept from turn to turn,
    so each turn forwards only its own new tokens (what a serving engine's prefix cache does).

    Args:
        target, prompt_ids, temperature, eos_token_id, generator, progress: as in
            `autoregressive_generate`; prompt_ids holds the first turn.
        max_new_tokens: the most tokens of each answer.
        follow_up: follow_up(turn, answer) -> None (the session ends) or (1, L) int64 ids
            appended after answer `turn` (0-based; `answer` its tokens, EOS included when it
            ended it): the rest of the assistant message when it was cut, the next user
            message and the generation prompt.
        max_context: the most positions the session may reach (default the target's
            max_position_embeddings): the KV cache is allocated for it.

    Raises:
        ValueError: as `autoregressive_generate`, max_context missing or beyond the target's
            limit, or a follow-up that is not (1, L) ids or would pass max_context (raised
            before that turn runs).
        RuntimeError(`runtime.BUSY`): a `TargetRuntime` in another generation.

    Returns:
        One GenerationResult per turn: `prompt_tokens` is the context before its answer,
        `prefill_s` the forward of the turn's new tokens with its first token.
    """
    capacity = _chat_capacity(target, prompt_ids, max_new_tokens, temperature, max_context)
    with runtime_session(target, capacity) as runtime:
        return _ar_loop(runtime, prompt_ids, max_new_tokens, temperature, eos_token_id,
                        generator, progress, follow_up, capacity)


def _verify(p_logits: torch.Tensor, drafts: List[int], q_probs: Optional[torch.Tensor],
            temperature: float, generator) -> List[int]:
    """Accept a prefix of `drafts` against target logits; returns the committed tokens.

    p_logits: (len(drafts) + 1, vocab) logits, a tensor or a `RowLogits` (rows computed as
    they are read), row j the target's for the slot of drafts[j] (the last row gives the bonus
    token); rows past the first rejection are never read. q_probs: (len(drafts), vocab) drafter
    probabilities (None at temperature 0).
    """
    if temperature == 0:
        for j, d in enumerate(drafts):
            best = int(p_logits[j].argmax())
            if best != d:
                return list(drafts[:j]) + [best]
        return list(drafts) + [int(p_logits[len(drafts)].argmax())]
    out: List[int] = []
    for j, d in enumerate(drafts):
        p = probabilities(p_logits[j], temperature)
        q = q_probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        if not u * q[d] <= p[d]:  # reject with probability 1 - min(1, p/q)
            residual = (p - q).clamp_min(0)   # positive somewhere since p[d] < q[d]
            return out + [int(torch.multinomial(residual, 1, generator=generator))]
        out.append(d)
    return out + [_pick(p_logits[len(drafts)], temperature, generator)]


def _cut(accepted: List[int], eos_token_id: Optional[int], room: int) -> List[int]:
    """`accepted` cut after its first EOS and to `room` tokens."""
    if eos_token_id in accepted:
        accepted = accepted[: accepted.index(eos_token_id) + 1]
    return accepted[:room]


def _record_step(result: GenerationResult, accepted: List[int], n_drafts: int, committed: int,
                 eos_token_id: Optional[int], max_new_tokens: int, tick) -> int:
    """Log one verification (statistics) and append its tokens to result.tokens, cut after EOS
    and at max_new_tokens; returns the new last token."""
    result.accept_lengths.append(len(accepted))
    result.draft_lengths.append(n_drafts)
    result.context_lengths.append(committed)
    accepted = _cut(accepted, eos_token_id, max_new_tokens - len(result.tokens))
    result.tokens.extend(accepted)
    tick(len(accepted))
    return result.tokens[-1]


@torch.no_grad()
def _prefill(runtime: TargetRuntime, drafter, prompt_ids: torch.Tensor, temperature: float,
             generator, progress, max_drafts: int, block_size: Optional[int] = None):
    """What every speculative loop does first, on a started runtime (`runtime_session`, which
    captures the drafter's layers): prepack the drafter, run the prompt, start the drafter's
    session on its hidden states (the drafter reads the runtime's prepared copy of the target)
    and commit the first token.

    Returns:
        (session, result, tick, start): `result.tokens` holds the first token,
        `result.prefill_s` its time; `start` is the perf_counter value the run began at.
    """
    prepare_drafter(drafter, quantised=is_quantised(runtime.model), target=runtime.model)
    tick = _Progress(progress)
    start = time.perf_counter()
    out = runtime.forward(prompt_ids, last_only=True)
    session = drafter.start(runtime.model, prompt_ids, out.hidden, runtime.cache)
    result = GenerationResult([_pick(out.logits[-1], temperature, generator)],
                              prompt_ids.shape[1], 1, 0.0,
                              block_size=block_size or max_drafts + 1)
    tick(1)
    result.prefill_s = time.perf_counter() - start
    return session, result, tick, start


@gc_paused
def speculative_generate(target, drafter, prompt_ids: torch.Tensor,
                         max_new_tokens: int, *, temperature: float = 0.0,
                         eos_token_id: Optional[int] = None,
                         generator: Optional[torch.Generator] = None,
                         progress=None, draft_threshold: float = 0.0,
                         policy: str = "fixed") -> GenerationResult:
    """Chain speculative decoding with any drafter (batch size 1), lossless.

    Args:
        target: a transformers causal LM or a `TargetRuntime` (as in `autoregressive_generate`).
        drafter: a `sharpdraft.drafters.base.Drafter` built for this target (DFlash, EAGLE-3,
            PARD, LongSpark; its `sharp` config is used as is), or any object with the session
            protocol (`eval.adapt.OnlineAdapter`). Its session proposes up to
            `drafter.max_drafts` tokens per step.
        prompt_ids, max_new_tokens, temperature, eos_token_id, generator, progress: as in
            `autoregressive_generate`.
        draft_threshold: in [0, 1]; 0 verifies every proposed draft, else drafts stop before the
            first whose drafter probability is below it (at least one draft is kept); the
            "fixed" policy's.
        policy: "fixed" (every step asks for max_drafts, cut by draft_threshold) or "auto"
            (draft length, or a target-only step, chosen each step from the request's measured
            costs and acceptance; `policy.py`).

    Raises:
        ValueError: as `autoregressive_generate`, draft_threshold outside [0, 1], an unknown
            policy, or a draft_threshold with policy "auto".
        RuntimeError(`runtime.BUSY`): a `TargetRuntime` in another generation.

    Returns:
        GenerationResult with accept_lengths / context_lengths of every verification forward.
    """
    if not 0.0 <= draft_threshold <= 1.0:
        raise ValueError(f"draft_threshold must lie in [0, 1], got {draft_threshold}")
    policy = resolve(policy, draft_threshold)
    capacity = _check(target, prompt_ids, max_new_tokens, temperature, drafter.max_drafts + 1)
    with runtime_session(target, capacity, drafter.hidden_layers) as runtime:
        return _chain_loop(runtime, drafter, prompt_ids, max_new_tokens, temperature,
                           eos_token_id, generator, progress, draft_threshold, policy)[0]


@gc_paused
@torch.no_grad()
def speculative_chat(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                     follow_up, *, temperature: float = 0.0,
                     eos_token_id: Optional[int] = None,
                     generator: Optional[torch.Generator] = None, progress=None,
                     draft_threshold: float = 0.0, policy: str = "fixed",
                     max_context: Optional[int] = None) -> List[GenerationResult]:
    """Chain speculative decoding of a multi-turn session, lossless: the target's KV cache, the
    drafter's session and the draft policy's estimates are kept from turn to turn. A turn's new
    tokens go through one target forward and reach the drafter as a commit after a propose of
    no drafts (`drafters.protocol`: the rows of a fully accepted verification).

    Args:
        target, drafter, prompt_ids, temperature, eos_token_id, generator, progress,
            draft_threshold, policy: as in `speculative_generate`; prompt_ids holds the first
            turn.
        max_new_tokens, follow_up, max_context: as in `autoregressive_chat`.

    Raises:
        ValueError: as `speculative_generate` and `autoregressive_chat`.
        RuntimeError(`runtime.BUSY`): a `TargetRuntime` in another generation.

    Returns:
        One GenerationResult per turn (as `autoregressive_chat`); the greedy answers equal
        `autoregressive_chat`'s.
    """
    if not 0.0 <= draft_threshold <= 1.0:
        raise ValueError(f"draft_threshold must lie in [0, 1], got {draft_threshold}")
    policy = resolve(policy, draft_threshold)
    extra = drafter.max_drafts + 1
    limit = _chat_capacity(target, prompt_ids, max_new_tokens, temperature, max_context)
    with runtime_session(target, limit + extra, drafter.hidden_layers) as runtime:
        return _chain_loop(runtime, drafter, prompt_ids, max_new_tokens, temperature,
                           eos_token_id, generator, progress, draft_threshold, policy,
                           follow_up, limit)


def _takes_max_drafts(session) -> bool:
    """Whether the session's propose takes `max_drafts` (`drafters.protocol`)."""
    propose = getattr(session, "propose", None)
    try:
        return propose is not None and "max_drafts" in inspect.signature(propose).parameters
    except (TypeError, ValueError):
        return False


def _confidences(d_logits: torch.Tensor, drafts: List[int]) -> List[float]:
    """The drafter probability (temperature 1) of each draft under its own row."""
    if not drafts:
        return []
    rows = torch.softmax(d_logits[:len(drafts)].float(), dim=-1)
    return rows[torch.arange(len(drafts)), drafts].tolist()


def _chain_loop(runtime, drafter, prompt_ids, max_new_tokens, temperature, eos_token_id,
                generator, progress, draft_threshold, policy, follow_up=None,
                max_context=None) -> List[GenerationResult]:
    """`speculative_generate`'s prefill and steps on a started runtime, one result per turn (a
    single one without `follow_up`; `speculative_chat`)."""
    session, result, tick, start = _prefill(runtime, drafter, prompt_ids, temperature,
                                            generator, progress, drafter.max_drafts)
    dev, last, tokens = prompt_ids.device, result.tokens[-1], result.tokens
    sized = _takes_max_drafts(session)
    pol = make_policy(policy, drafter, draft_threshold, sized=sized, target=runtime.model)
    # a drafter that drafts one token a forward stops where the policy says (fixed: where
    # its threshold cuts, the same drafts)
    one_by_one = getattr(drafter, "drafts_one_by_one", False)
    cutting = policy == "auto" or draft_threshold > 0
    results: List[GenerationResult] = []
    while True:
        while last != eos_token_id and len(tokens) < max_new_tokens:
            t0 = time.perf_counter()
            committed = runtime.length                  # = position of `last`
            asked = pol.plan()
            sizing = {"max_drafts": asked} if sized and asked != drafter.max_drafts else {}
            stop_p = pol.stop_below() if one_by_one and asked else 0.0
            stop = {"stop_below": stop_p} if stop_p > 0 else {}
            drafts, d_logits = session.propose(last, committed,
                                               lambda row: _pick(row, temperature, generator),
                                               **stop, **sizing)
            conf = _confidences(d_logits, drafts) if cutting else []
            n_draft = pol.cut(conf, time.perf_counter() - t0) if cutting else len(drafts)
            drafts, d_logits = drafts[:n_draft], d_logits[:n_draft]
            q_probs = None if temperature == 0 or not drafts else probabilities(d_logits,
                                                                                temperature)
            t1 = time.perf_counter()
            ids = torch.tensor([[last] + drafts], device=dev)
            out = runtime.forward(ids)
            result.target_forwards += 1
            accepted = _verify(out.row_logits, drafts, q_probs, temperature, generator)
            # nothing past EOS or the answer's budget is committed: the next turn of a session
            # starts right after the answer, in the target's cache and the drafter's session
            accepted = _cut(accepted, eos_token_id, max_new_tokens - len(tokens))
            runtime.crop(committed + len(accepted))     # roll back past the first rejection
            t2 = time.perf_counter()
            session.commit(accepted, out.hidden)
            draft_s = (t1 - t0) + (time.perf_counter() - t2)
            result.draft_s += draft_s
            result.verify_s += t2 - t1
            pol.observe(asked, draft_s, conf, len(drafts), len(accepted) - 1, t2 - t1)
            last = _record_step(result, accepted, len(drafts), committed, eos_token_id,
                                max_new_tokens, tick)
        result.wall_s = time.perf_counter() - start
        result.policy = pol.report()
        results.append(result)
        turn = _next_turn(follow_up, results, runtime, max_new_tokens, max_context)
        if turn is None:
            return results
        start = time.perf_counter()
        last = _append_turn(runtime, session, sized, last, turn.to(dev), temperature, generator)
        result = GenerationResult([last], runtime.length, 1, 0.0,
                                  block_size=drafter.max_drafts + 1)
        tokens = result.tokens
        tick(1)
        result.prefill_s = time.perf_counter() - start


def _append_turn(runtime, session, sized: bool, last: int, turn: torch.Tensor, temperature,
                 generator) -> int:
    """Run a follow-up turn's (1, L) ids after `last` (committed, not yet forwarded) through the
    target and hand them to the drafter's session as an accepted step; returns the answer's
    first token."""
    committed = runtime.length
    draw = lambda row: _pick(row, temperature, generator)    # noqa: E731
    if sized:                          # no drafts: the session only notes `last`
        session.propose(last, committed, draw, max_drafts=0)
    else:                              # a session that always drafts: its drafts are dropped
        session.propose(last, committed, draw)
    ids = torch.cat([turn.new_tensor([[last]]), turn], dim=1)
    out = runtime.forward(ids)
    first = _pick(out.row_logits[ids.shape[1] - 1], temperature, generator)
    session.commit(turn[0].tolist() + [first], out.hidden)
    return first


def verify_tree(p_logits: torch.Tensor, tree, temperature: float, generator) -> tuple:
    """Walk a draft tree against target logits; returns (accepted node indices, committed tokens).

    p_logits: (1 + N, vocab), a tensor or a `RowLogits`; row 0 is the target's distribution
    after the root (the last committed token), row 1 + i after node i. A `RowLogits` computes
    each node's row together with its children's (the only rows read next). Greedy: descend into the child equal to the
    target's argmax while one exists. Sampling: recursive rejection over the children, each a
    fixed (point-mass) proposal: child x is accepted with probability p(x); on rejection p
    becomes norm(p with x set to 0) and the next sibling is tried; after the last sibling a token
    is drawn from what is left. Either way the committed tokens follow the target's own
    distribution (greedy: equal its argmax).
    """
    path, out, node = [], [], -1
    while True:
        kids = tree.children(node)
        row = (p_logits.row(node + 1, with_rows=[1 + c for c in kids])
               if isinstance(p_logits, RowLogits) else p_logits[node + 1])
        if temperature == 0:
            best = int(row.argmax())
            nxt = next((c for c in kids if tree.tokens[c] == best), None)
            if nxt is None:
                return path, out + [best]
        else:
            p = probabilities(row, temperature)
            nxt = None
            for c in kids:
                x = tree.tokens[c]
                if float(torch.rand((), generator=generator)) < float(p[x]):
                    nxt = c
                    break
                p = p.clone()
                p[x] = 0.0
                p = p / p.sum()
            if nxt is None:
                return path, out + [int(torch.multinomial(p, 1, generator=generator))]
        path.append(nxt)
        out.append(tree.tokens[nxt])
        node = nxt


@gc_paused
@torch.no_grad()
def tree_speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, *,
                              temperature: float = 0.0, eos_token_id: Optional[int] = None,
                              generator: Optional[torch.Generator] = None,
                              progress=None, policy: str = "fixed") -> GenerationResult:
    """Tree speculative decoding (batch size 1), lossless, with a drafter whose session has
    `propose_tree` (EAGLE-3). Greedy output equals target-only output exactly: the kernel
    computes a tree node's row with the same bits as the row decoded alone (docs/runtime.md).

    Each step the drafter proposes a tree of N nodes (`DraftTree`); the target runs once over
    [last ; nodes] with a tree mask (every node sees the committed prefix, the root, its
    ancestors and itself, at position P + depth); `verify_tree` commits the accepted path plus one
    target token, and the target cache keeps only the path's entries.

    Args: as `speculative_generate` (no draft_threshold); policy "fixed" drafts a tree every
    step, "auto" a tree or a target-only step, whichever the request's measured costs and
    acceptance favour (`policy.py`). Returns: GenerationResult (draft_lengths holds the tree
    sizes, 0 for a target-only step).

    Raises:
        ValueError: as `speculative_generate`, or a drafter that does not draft trees.
        RuntimeError(`runtime.BUSY`): a `TargetRuntime` in another generation.
    """
    if not getattr(drafter, "drafts_trees", False):
        raise ValueError(f"drafter: {type(drafter).__name__} does not draft trees (EAGLE-3 "
                         f"does); use speculative_generate")
    policy = resolve(policy, None)
    capacity = _check(target, prompt_ids, max_new_tokens, temperature,
                      drafter.max_tree_nodes + 1)
    with runtime_session(target, capacity, drafter.hidden_layers) as runtime:
        return _tree_loop(runtime, drafter, prompt_ids, max_new_tokens, temperature,
                          eos_token_id, generator, progress, policy)


def _tree_loop(runtime, drafter, prompt_ids, max_new_tokens, temperature, eos_token_id,
               generator, progress, policy) -> GenerationResult:
    """`tree_speculative_generate`'s prefill and steps on a started runtime."""
    session, result, tick, start = _prefill(runtime, drafter, prompt_ids, temperature,
                                            generator, progress, drafter.max_tree_nodes,
                                            block_size=drafter.max_tree_depth + 1)
    dev, last, tokens = prompt_ids.device, result.tokens[-1], result.tokens
    pol = make_policy(policy, drafter, tree=True, sized=_takes_max_drafts(session),
                      target=runtime.model)
    while last != eos_token_id and len(tokens) < max_new_tokens:
        t0 = time.perf_counter()
        committed = runtime.length
        asked = pol.plan()
        if asked == 0:                 # a target-only step: a chain propose of no drafts
            session.propose(last, committed, lambda row: _pick(row, temperature, generator),
                            max_drafts=0)
            t1 = time.perf_counter()
            n = 0
            out = runtime.forward(torch.tensor([[last]], device=dev))
            path, accepted = [], [_pick(out.row_logits[0], temperature, generator)]
        else:
            tree = session.propose_tree(last, committed)
            t1 = time.perf_counter()
            n = len(tree)
            mask = torch.zeros(1 + n, committed + 1 + n, dtype=torch.bool, device=dev)
            mask[:, :committed + 1] = True
            mask[1:, committed + 1:] = tree.mask(dev)
            pos = torch.tensor([[committed] + [committed + d for d in tree.depths]], device=dev)
            ids = torch.tensor([[last] + tree.tokens], device=dev)
            out = runtime.forward(ids, attention_mask=mask[None, None], position_ids=pos)
            path, accepted = verify_tree(out.row_logits, tree, temperature, generator)
            runtime.keep(committed + 1, path)
        result.target_forwards += 1
        t2 = time.perf_counter()
        rows = torch.tensor([0] + [1 + i for i in path], device=dev)
        session.commit(accepted, {i: h.index_select(1, rows) for i, h in out.hidden.items()})
        draft_s = (t1 - t0) + (time.perf_counter() - t2)
        result.draft_s += draft_s
        result.verify_s += t2 - t1
        pol.observe(asked, draft_s, [], n, len(accepted) - 1, t2 - t1)
        last = _record_step(result, accepted, n, committed, eos_token_id, max_new_tokens, tick)
    result.wall_s = time.perf_counter() - start
    result.policy = pol.report()
    return result
