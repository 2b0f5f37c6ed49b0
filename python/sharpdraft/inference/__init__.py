"""Decoding: the one engine loop that knows no drafter (`engine`: target-only, chain and tree
speculative decoding, lossless; `autoregressive_chat` / `speculative_chat` for multi-turn sessions
that keep their caches) and `generate`, the single entry point over them; batched
target-only decoding for the corpus (`batched`); the one sampler both use (`sampling`: greedy,
temperature, top-p).

Layer: above `target` and `drafters` (it talks to drafters only through the session protocol of
`drafters.protocol`); below data, training, eval and the CLI.
"""
from .decode import generate, prompt_ids
from .engine import (GenerationResult, autoregressive_chat, autoregressive_generate, seq_rep,
                     speculative_chat, speculative_generate, tree_speculative_generate)

__all__ = ["GenerationResult", "autoregressive_chat", "autoregressive_generate", "generate",
           "prompt_ids", "seq_rep", "speculative_chat", "speculative_generate",
           "tree_speculative_generate"]
