"""Text for training and evaluation, all installable offline: the document sources and their
deterministic train / held-out splits (`sources`), and the self-distilled corpus of the
target's own responses (`corpus`: generation and resume), made of prompts (`prompts`, with the
stdlib source rewriting of `code_edits`) and stored as shards (`shards`: format and reading).

Layer: above `inference` (the corpus is generated with the target); below `training` and `eval`.
"""
from .sources import (SOURCES, SPLITS, available_sources, document_text, documents, kjv_text,
                      kjv_verses, pack_sequences, tokenizer_encoder)

__all__ = ["SOURCES", "SPLITS", "available_sources", "document_text", "documents", "kjv_text",
           "kjv_verses", "pack_sequences", "tokenizer_encoder"]
