"""Helpers every drafter kind shares (no drafter-specific code): which target layers a drafter
reads, and which token id stands for a masked slot."""
from __future__ import annotations

from typing import List


def evenly_spaced_layers(num_target_layers: int, num_features: int = 4) -> List[int]:
    """Target layers whose outputs form the context: round(1 + i (L - 3) / (n - 1)), i < n.

    For 30 target layers and 4 features this is [1, 10, 19, 28]. Index l is the output of
    decoder layer l (hidden_states[l + 1] of a transformers forward with output_hidden_states).
    Every recipe of the default target caches `evenly_spaced_layers(L, 4)` (or reads a subset),
    so one set of target forwards serves every drafter.

    Raises:
        ValueError: num_features < 2 or num_target_layers < 3.
    """
    if num_features < 2 or num_target_layers < 3:
        raise ValueError(f"evenly_spaced_layers needs num_features >= 2 and num_target_layers >= 3,"
                         f" got {num_features} and {num_target_layers}")
    return [round(1 + i * (num_target_layers - 3) / (num_features - 1))
            for i in range(num_features)]


def default_mask_token_id(tokenizer) -> int:
    """The mask token: the tokenizer's pad, else unk token (one that is not EOS), else its last id.

    For SmolLM2 (pad = EOS = <|im_end|>) this is <|endoftext|>, id 0.
    """
    for tok in (tokenizer.pad_token_id, tokenizer.unk_token_id):
        if tok is not None and tok != tokenizer.eos_token_id:
            return int(tok)
    return len(tokenizer) - 1
