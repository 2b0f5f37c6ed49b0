"""`generate`: one call for target-only, chain or tree speculative decoding of a prompt."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .engine import (GenerationResult, autoregressive_generate, speculative_generate,
                     tree_speculative_generate)
from .policy import resolve


def prompt_ids(tokenizer, prompt: str, context: Optional[str] = None,
               chat: bool = True) -> torch.Tensor:
    """(1, L) int64 token ids of `context` (if any), a blank line and `prompt`, rendered with the
    tokenizer's chat template as one user turn when `chat` and the tokenizer has a template."""
    text = f"{context}\n\n{prompt}" if context else prompt
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_dict=False)
        return torch.tensor([list(ids)])
    return tokenizer(text, return_tensors="pt").input_ids


def generate(target, drafter, prompt: Union[str, torch.Tensor], *, tokenizer=None,
             max_new_tokens: int = 128, tree: bool = False, temperature: float = 0.0,
             draft_threshold: Optional[float] = None, policy: Optional[str] = None,
             seed: int = 0, eos_token_id: Optional[int] = None, chat: bool = True,
             progress=None) -> GenerationResult:
    """Decode `prompt` with `target`, speculatively with `drafter` (None: target-only).

    Lossless: at temperature 0 the tokens equal target-only greedy decoding; above it they are
    distributed as the target's own samples (docs/spec.md, the engine's acceptance rule).

    Args:
        target: a transformers causal LM (`load_target`; left as it is, run through a runtime
            prepared with the "auto" plan and kept for its later calls), or a
            `sharpdraft.target.TargetRuntime` (`TargetRuntime.prepare(model, plan)`: another
            plan, or one runtime per thread).
        drafter: a drafter (`load_drafter`) or None for target-only decoding.
        prompt: text (needs `tokenizer`; rendered as one chat turn when `chat`) or (1, L) int64
            token ids.
        tokenizer: the target's tokenizer; also gives the default `eos_token_id`.
        max_new_tokens: tokens to generate (>= 1), EOS included.
        tree: tree drafting (a drafter whose `drafts_trees` is True) instead of chain drafting.
        temperature: 0 = greedy; > 0 = speculative sampling from softmax(logits / temperature).
        draft_threshold: in [0, 1], the "fixed" policy's: chain drafting verifies drafts only
            up to the first whose drafter probability is below it (0: all). None: the
            drafter's measured default (`Drafter.default_draft_threshold`) in chain drafting, 0
            otherwise.
        policy: "auto" (draft length, tree or a target-only step chosen each step from the
            request's measured costs and acceptance, `inference.policy`) or "fixed" (every step
            drafts in full, cut by draft_threshold). None: "fixed".
        seed: seed of the sampling generator.
        progress: optional callable(n) told of every n newly committed tokens.

    Returns:
        `GenerationResult`: the new token ids, tau, timings (`summary()` for a JSON-able dict).

    Raises:
        ValueError naming the argument: text prompt without tokenizer, bad ids shape,
            max_new_tokens < 1, negative temperature, draft_threshold outside [0, 1], an unknown
            policy or a draft_threshold with policy "auto", a tree with a chain-only drafter, or prompt + max_new_tokens past the target's context
            (max_position_embeddings).
        RuntimeError: a `TargetRuntime` that another generation is using.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: a text prompt needs tokenizer= (or pass token ids)")
        ids = prompt_ids(tokenizer, prompt, chat=chat)
    else:
        ids = prompt
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    kwargs = dict(temperature=temperature, eos_token_id=eos_token_id, progress=progress,
                  generator=torch.Generator().manual_seed(seed))
    if drafter is None:
        if tree or draft_threshold:
            raise ValueError("drafter: tree / draft_threshold need a drafter")
        return autoregressive_generate(target, ids, max_new_tokens, **kwargs)
    if tree:
        if draft_threshold:
            raise ValueError("draft_threshold: applies to chain drafting, not tree=True")
        return tree_speculative_generate(target, drafter, ids, max_new_tokens,
                                         policy=resolve(policy, None), **kwargs)
    policy = resolve(policy, draft_threshold)
    if draft_threshold is None:
        draft_threshold = drafter.default_draft_threshold if policy == "fixed" else 0.0
    return speculative_generate(target, drafter, ids, max_new_tokens,
                                draft_threshold=draft_threshold, policy=policy, **kwargs)
