"""Held-out user tasks for measurements: requests like the ones people send, none of them in any
corpus or training run.

- story: a short story request; code: a short coding request (both written here, not drawn from
  a source the corpus reads);
- document: a licence text from /usr/share/common-licenses (held out from every corpus:
  `sources` never reads it) followed by a question about it. "Artistic" is about 1.4k tokens
  with the SmolLM2 tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List

LICENCES = Path("/usr/share/common-licenses")

STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CODE = ("Write a Python function that merges two sorted lists into one sorted list, with a "
        "docstring and two examples.")
QUESTION = ("What may someone who modifies the package do with it, and what must they do in "
            "return? Answer in a few sentences.")


@dataclass(frozen=True)
class Task:
    """One user turn: `name` (story, code, document) and its text."""

    name: str
    user: str


def user_tasks(licence: str = "Artistic") -> List[Task]:
    """The story, code and document tasks, in that order.

    Args:
        licence: a file name in /usr/share/common-licenses (the document task's text).

    Raises:
        FileNotFoundError naming the file: the licence text is missing.
    """
    path = LICENCES / licence
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the document task's text is missing (Debian's "
                                f"base-files installs /usr/share/common-licenses)")
    return [Task("story", STORY), Task("code", CODE),
            Task("document", f"{path.read_text()}\n\n{QUESTION}")]
