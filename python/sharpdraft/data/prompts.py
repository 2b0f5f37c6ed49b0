"""The corpus's prompt set: prompts built from the documents of `sharpdraft.data.sources`, and
their rendering to token ids with the target's chat template.

Every split's prompts come only from that split's documents (held out: Genesis, the first champ
problems, about one in ten HumanEval tasks and stdlib files), so no held-out document ever
reaches train. Kinds of prompt (`KINDS`), per source:

* kjv: a passage (about 100-650 tokens) with an instruction: summarise, list, explain,
  continue, or a question;
* champ: a problem to solve step by step (two phrasings each);
* humaneval: complete the function, or explain it;
* stdlib: one function: explain it, document it (its docstring removed), or find the bug (one
  operator flipped; see `code_edits`);
* followup (`FOLLOWUP`): each prompt also carries a second user turn, asked after the target's
  first response when the corpus picks it for a follow-up.
"""
from __future__ import annotations

import importlib.metadata
import json
import random
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .._hashing import sha256_chunks
from . import code_edits
from . import sources as data

KINDS: Dict[str, Tuple[str, ...]] = {
    "kjv": ("summarise", "list", "explain", "continue", "question"),
    "champ": ("solve",),
    "humaneval": ("complete", "explain"),
    "stdlib": ("explain", "document", "find_bug"),
}
FOLLOWUP = "followup"
MIX = {"kjv": 0.4, "stdlib": 0.25, "champ": 0.15, "humaneval": 0.2}
PASSAGE_CHARS = (400, 2600)       # KJV passages: about 100-650 tokens
FUNCTION_CHARS = (200, 2000)      # stdlib functions: about 60-650 tokens

# ----- instructions -------------------------------------------------------------------------------
KJV_INSTRUCTIONS = {
    "summarise": ("Summarise the passage above in a few sentences.",
                  "Write a short summary of this passage.",
                  "Give a one-paragraph summary of what happens in this passage."),
    "list": ("List the people and places named in this passage.",
             "List the main events of this passage in order, as bullet points.",
             "Make a numbered list of the key points of this passage."),
    "explain": ("Explain this passage in plain modern English.",
                "Explain what this passage means and why it might matter to a reader.",
                "Rewrite this passage in simple modern English, then explain it briefly."),
    "continue": ("Continue this text in the same style for a few more verses.",
                 "Write what might come next, in the same style as the passage."),
    "question": ("Who are the main people in this passage, and what do they do?",
                 "What is the most important thing that happens in this passage?",
                 "What does this passage teach? Answer briefly.",
                 "Where and when does this passage take place, as far as the text says?"),
}
FOLLOWUPS = {
    "kjv": ("Can you make that shorter?", "Explain that again more simply, as if to a child.",
            "Now summarise your answer in one sentence.",
            "Which part of the passage supports your answer? Quote it."),
    "champ": ("Can you check your answer another way?", "Explain the key step in more detail.",
              "Now summarise the solution in two sentences."),
    "humaneval": ("Can you write a few tests for this function?",
                  "What is the time complexity of your solution?",
                  "Can you make the code simpler?"),
    "stdlib": ("Can you give an example of calling it?", "What could go wrong with this code?",
               "Now explain it in one sentence."),
}


# ----- the prompt set -----------------------------------------------------------------------------
@dataclass
class Prompt:
    """One prompt: `user` is the first user message, `followup` the second user turn used when
    this prompt is chosen for a follow-up. `doc` names the `sources` document it comes from."""

    source: str
    doc: str
    kind: str
    user: str
    followup: str


def _kjv_prompts(docs: List[dict], rng: random.Random) -> List[Prompt]:
    """Consecutive passages of each book (PASSAGE_CHARS characters), the kinds in rotation."""
    out: List[Prompt] = []
    kinds = KINDS["kjv"]
    for doc in docs:
        verses = data.document_text(doc).split("\n")
        start = 0
        while start < len(verses):
            target = rng.randint(*PASSAGE_CHARS)
            end, size = start, 0
            while end < len(verses) and size < target:
                size += len(verses[end]) + 1
                end += 1
            if size < PASSAGE_CHARS[0] // 2:     # a short tail: not worth a prompt
                break
            passage = "\n".join(verses[start:end])
            kind = kinds[len(out) % len(kinds)]
            instruction = rng.choice(KJV_INSTRUCTIONS[kind])
            user = (f"{passage}\n\n{instruction}" if rng.random() < 0.7
                    else f"{instruction}\n\n{passage}")
            out.append(Prompt("kjv", doc["name"], kind, user, rng.choice(FOLLOWUPS["kjv"])))
            start = end
    return out


def _champ_prompts(docs: List[dict], rng: random.Random) -> List[Prompt]:
    """Each problem twice, in two phrasings of "solve it step by step"."""
    out = []
    for doc in docs:
        problem = doc["chat"][0].rsplit("\nSolve it step by step.", 1)[0]
        for user in (f"{problem}\nSolve it step by step.",
                     f"Solve the following problem. Show your reasoning step by step and state the "
                     f"final answer.\n\n{problem}"):
            out.append(Prompt("champ", doc["name"], "solve", user, rng.choice(FOLLOWUPS["champ"])))
    return out


def _humaneval_prompts(docs: List[dict], rng: random.Random) -> List[Prompt]:
    """Each task twice: complete the function, explain what it should do."""
    out = []
    for doc in docs:
        stub = doc["chat"][0].split("\n\n", 1)[1]     # the task's prompt: signature + docstring
        users = {"complete": f"Complete this Python function.\n\n```python\n{stub}```",
                 "explain": f"Explain what this Python function should do, and describe how you "
                            f"would implement it.\n\n```python\n{stub}```"}
        for kind in KINDS["humaneval"]:
            out.append(Prompt("humaneval", doc["name"], kind, users[kind],
                              rng.choice(FOLLOWUPS["humaneval"])))
    return out


def _stdlib_prompts(docs: List[dict], rng: random.Random) -> List[Prompt]:
    """Every function of FUNCTION_CHARS size: explain, document (docstring removed) or find the
    bug (one token flipped by `code_edits.mutate`), in rotation; explain where the kind does not
    apply."""
    out = []
    for doc in docs:
        module = doc["name"][:-3].replace("/", ".").replace(".__init__", "")
        for code, doc_span in code_edits.functions(data.document_text(doc), *FUNCTION_CHARS):
            kind = KINDS["stdlib"][len(out) % 3]
            if kind == "document" and doc_span is not None:
                user = (f"Write a docstring for this function from the Python standard library "
                        f"module `{module}`.\n\n```python\n"
                        f"{code_edits.without_lines(code, doc_span)}\n```")
            elif kind == "find_bug" and (bad := code_edits.mutate(code, rng)) is not None:
                user = (f"This function contains one bug: a single small change to the "
                        f"original. Find it and explain how to fix it.\n\n```python\n{bad}\n```")
            else:
                kind = "explain"
                user = (f"Explain what this function from the Python standard library module "
                        f"`{module}` does.\n\n```python\n{code}\n```")
            out.append(Prompt("stdlib", doc["name"], kind, user, rng.choice(FOLLOWUPS["stdlib"])))
    return out


BUILDERS = {"kjv": _kjv_prompts, "champ": _champ_prompts, "humaneval": _humaneval_prompts,
            "stdlib": _stdlib_prompts}


def build_prompts(split: str, seed: int = 0, sources: Sequence[str] = data.SOURCES,
                  documents: Optional[Callable[[str, str], List[dict]]] = None
                  ) -> Tuple[List[Prompt], List[str]]:
    """The prompt set of one split, in its generation order (a function of `seed` only).

    Each source's prompts are built from `documents(source, split)` and shuffled (seeded), then
    interleaved by drawing a source for every position with weights MIX among the sources not
    yet exhausted.

    Returns:
        (prompts, unavailable): sources whose package is missing are skipped and listed.

    Raises:
        ValueError: unknown split or source.
    """
    if split not in data.SPLITS:
        raise ValueError(f"split must be one of {data.SPLITS}, got {split!r}")
    documents = documents or data.documents
    pools: Dict[str, List[Prompt]] = {}
    unavailable = []
    for source in sources:
        if source not in BUILDERS:
            raise ValueError(f"unknown source {source!r}; expected one of {tuple(BUILDERS)}")
        try:
            docs = documents(source, split)
        except (importlib.metadata.PackageNotFoundError, FileNotFoundError):
            unavailable.append(source)
            continue
        pool = BUILDERS[source](docs, random.Random(f"{seed}-{source}-{split}-build"))
        random.Random(f"{seed}-{source}-{split}-order").shuffle(pool)
        if pool:
            pools[source] = pool[::-1]          # pop() from the end = the shuffled order
    rng = random.Random(f"{seed}-{split}-mix")
    order: List[Prompt] = []
    while pools:
        names = sorted(pools)
        source = rng.choices(names, weights=[MIX[s] for s in names])[0]
        order.append(pools[source].pop())
        if not pools[source]:
            del pools[source]
    return order, unavailable


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """sha256 of a prompt set (source, doc, kind and texts of every prompt, in order)."""
    return sha256_chunks(json.dumps(asdict(p), sort_keys=True).encode() for p in prompts)


# ----- rendering ----------------------------------------------------------------------------------
def render(tokenizer, messages: Sequence[dict]) -> List[int]:
    """Token ids of a conversation ending with the assistant's turn to speak: the tokenizer's
    chat template, or plain "role: content" text when it has none."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                            return_dict=False)
        return [int(i) for i in ids]
    text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:"
    return list(tokenizer(text).input_ids)


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id (0 when it has neither)."""
    for i in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if i is not None:
            return int(i)
    return 0
