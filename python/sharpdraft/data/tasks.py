"""Held-out user tasks for measurements: requests like the ones people send, none of them in any
corpus or training run.

- story: a short story request; code: a short coding request (both written here, not drawn from
  a source the corpus reads);
- document: a licence text from /usr/share/common-licenses (held out from every corpus:
  `sources` never reads it) followed by a question about it. "Artistic" is about 1.4k tokens
  with the SmolLM2 tokenizer.

`suite` is the held-out task suite of `sharpdraft bench --suite tasks`: a few prompts per
category (`SUITE`): story / chat and code requests written here, held-out competition maths
problems (the first `sources.CHAMP_HELD_OUT` of champ-dataset, never in a corpus) and
questions on licence documents cut to about 2k, 4k and 6k tokens.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

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


def licence_text(name: str) -> str:
    """The text of /usr/share/common-licenses/`name`.

    Raises:
        FileNotFoundError naming the file: the licence text is missing.
    """
    path = LICENCES / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the document task's text is missing (Debian's "
                                f"base-files installs /usr/share/common-licenses)")
    return path.read_text()


def user_tasks(licence: str = "Artistic") -> List[Task]:
    """The story, code and document tasks, in that order.

    Args:
        licence: a file name in /usr/share/common-licenses (the document task's text).

    Raises:
        FileNotFoundError naming the file: the licence text is missing.
    """
    text = licence_text(licence)
    return [Task("story", STORY), Task("code", CODE),
            Task("document", f"{text}\n\n{QUESTION}")]


# ----- the held-out task suite -----------------------------------------------------------------
CHAT = (
    STORY,
    "Write a friendly letter to a neighbour thanking them for looking after my cat while I was "
    "away, and offer to return the favour.",
    "Write a short poem about the first snow of winter in a small town.",
    "I have a free weekend and a small budget. Suggest five things I could do at home or nearby, "
    "with a sentence on each.",
)
CODING = (
    CODE,
    "Write a Python class for a fixed-size ring buffer with append, pop and a method that "
    "returns the items in order. Add a short usage example.",
    "Write a Python function that counts how often each word appears in a text file and "
    "prints the ten most common words.",
)
# (documents, question) per size: licence texts cut to about `size` tokens
DOCUMENTS: Dict[int, Tuple[Tuple[str, str], ...]] = {
    2048: (("Apache-2.0", "What does this licence require of someone who redistributes the "
                          "work? Answer in a few sentences."),
           ("MPL-2.0", "Summarise the main conditions of this document as five bullet points.")),
    4096: (("GPL-2", "Explain in plain words what a person who modifies this program and gives "
                     "it to others must do."),
           ("GFDL-1.3", "What is this document about, and who is it meant for? Answer in a "
                        "short paragraph.")),
    6144: (("LGPL-2.1", "How does this licence treat a program that only links to the library? "
                        "Answer briefly."),
           ("GPL-3", "List the obligations this text places on someone who conveys the work, "
                     "in a few sentences.")),
}
SUITE = ("story", "code", "maths", "doc-2k", "doc-4k", "doc-6k")
DOC_SIZES = {"doc-2k": 2048, "doc-4k": 4096, "doc-6k": 6144}   # tokens a document is cut to


def _check_categories(categories: Sequence[str]) -> None:
    unknown = [c for c in categories if c not in SUITE]
    if unknown:
        raise ValueError(f"--suite categories: unknown {unknown}; known: {list(SUITE)}")


def cut_document(tokenizer, name: str, tokens: int) -> str:
    """The licence text `name` cut to its first `tokens` tokens of the target's tokenizer, at a
    line end (the whole text when it is shorter).

    Raises:
        FileNotFoundError naming the file: the licence text is missing.
    """
    text = licence_text(name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= tokens:
        return text
    cut = tokenizer.decode(ids[:tokens])
    return cut[:cut.rfind("\n")] if "\n" in cut else cut


def held_out_problems(what: str) -> List[dict]:
    """The held-out champ-dataset problems (the first `sources.CHAMP_HELD_OUT`, never in a
    corpus).

    Raises:
        ModuleNotFoundError saying how to install it, naming `what` needs it: champ-dataset is
            absent.
    """
    from . import sources
    try:
        return sources.champ_problems()[:sources.CHAMP_HELD_OUT]
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(f"{what} needs champ-dataset: pip install "
                                  f"champ-dataset==1.0.0") from None


def suite_names(categories: Sequence[str] = SUITE, maths: int = 2) -> List[str]:
    """The names of `suite`'s tasks in the same order ("story-0", ..., "doc-6k-GPL-3"), known
    without a tokenizer or any file (what a command line checks a task name against).

    Raises:
        ValueError: an unknown category.
    """
    _check_categories(categories)
    from .sources import CHAMP_HELD_OUT

    count = {"story": len(CHAT), "code": len(CODING), "maths": min(maths, CHAMP_HELD_OUT)}
    out = []
    for c in SUITE:
        if c not in categories:
            continue
        if c in count:
            out += [f"{c}-{i}" for i in range(count[c])]
        else:
            out += [f"{c}-{name}" for name, _ in DOCUMENTS[DOC_SIZES[c]]]
    return out


def suite(tokenizer, categories: Sequence[str] = SUITE, maths: int = 2) -> List[dict]:
    """The held-out task suite: [{"name", "kind" (the category), "text"}], in `SUITE` order.

    Args:
        tokenizer: the target's tokenizer (documents are cut to a token count).
        categories: a subset of `SUITE`.
        maths: held-out champ-dataset problems in the maths category.

    Raises:
        ValueError: an unknown category.
        ModuleNotFoundError saying how to install it: "maths" asked for and champ-dataset absent.
        FileNotFoundError naming the file: a licence text is missing.
    """
    _check_categories(categories)
    out = []
    for c in SUITE:
        if c not in categories:
            continue
        if c == "story":
            out += [{"name": f"story-{i}", "kind": c, "text": t} for i, t in enumerate(CHAT)]
        elif c == "code":
            out += [{"name": f"code-{i}", "kind": c, "text": t} for i, t in enumerate(CODING)]
        elif c == "maths":
            problems = held_out_problems("the suite's maths category")[:maths]
            out += [{"name": f"maths-{i}", "kind": c,
                     "text": f"{p['problem']}\nSolve it step by step."}
                    for i, p in enumerate(problems)]
        else:
            size = DOC_SIZES[c]
            out += [{"name": f"{c}-{name}", "kind": c,
                     "text": f"{cut_document(tokenizer, name, size)}\n\n{question}"}
                    for name, question in DOCUMENTS[size]]
    return out
