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
* pydoc, debdoc, man (documentation: docstrings, package documents, manual pages): a section
  (about 100-750 tokens) to summarise, explain, question, list, rewrite or classify; one
  prompt in `LONG_SHARE` takes a long stretch (about 1k-6k tokens, `LONG_CHARS`) to summarise
  or question instead;
* compose: write a story, letter, poem, dialogue or description, give advice or brainstorm,
  on a subject (`sources.COMPOSE_SUBJECTS`), each subject in every form;
* followup (`FOLLOWUP`): each prompt also carries a second user turn, asked after the target's
  first response when the corpus picks it for a follow-up.
"""
from __future__ import annotations

import importlib.metadata
import json
import random
import re
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
    "pydoc": ("summarise", "explain", "question", "example"),
    "debdoc": ("summarise", "explain", "question", "list", "rewrite", "classify"),
    "man": ("summarise", "explain", "question", "list", "rewrite", "classify"),
    "compose": data.COMPOSE_FORMS,
}
LONG_KINDS = ("long_summarise", "long_question")   # documentation sources, long stretches
FOLLOWUP = "followup"
# the first four keep their first weights' ratios (halved: the same draws when only they are
# chosen, so a corpus made from them resumes with --sources kjv champ humaneval stdlib)
MIX = {"kjv": 0.2, "stdlib": 0.125, "champ": 0.075, "humaneval": 0.1, "pydoc": 0.1,
       "debdoc": 0.12, "man": 0.12, "compose": 0.16}
SECTION_CHARS = (400, 3000)       # documentation sections: about 100-750 tokens
LONG_CHARS = (4000, 24000)        # long stretches: about 1k-6k tokens
LONG_SHARE = 0.2
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
    "docs": ("Can you make that shorter?", "Give me an example of how I would use this.",
             "Which part of the text supports your answer?", "Explain that to a beginner.",
             "What should I be careful about?"),
    "compose": ("Make it shorter.", "Now give it a title.", "Rewrite it in a funnier tone.",
                "Can you make it more formal?", "Write a second version with a different "
                "ending."),
}
DOC_INSTRUCTIONS = {
    "summarise": ("Summarise this text in a few sentences.",
                  "Write a short summary of what this documentation says.",
                  "Give a one-paragraph summary of this text for a busy reader."),
    "explain": ("Explain what this text is about to someone new to the topic.",
                "Explain the main idea of this text in plain words.",
                "What does this text mean for someone who uses the program? Explain briefly."),
    "question": ("According to this text, what is the first thing a user should do?",
                 "What problem does the thing described here solve, and how is it used?",
                 "What are the most important details in this text? Answer briefly.",
                 "Is anything in this text a warning or a limitation? Explain."),
    "list": ("List the options, steps or items described in this text, with a short note on "
             "each.", "Make a bulleted list of the key points of this text.",
             "List every command or setting this text mentions."),
    "rewrite": ("Rewrite this text as a short, friendly how-to for beginners.",
                "Rewrite the first part of this text in simpler words.",
                "Turn this text into a short FAQ with three questions and answers."),
    "classify": ("Which of these fits this text best: installation guide, reference manual, "
                 "release notes, tutorial, bug-reporting guide, design notes, or other? Give the "
                 "category and one sentence of reasoning.",
                 "Is the program or library described here mainly for networking, files and "
                 "text, system administration, software development, graphics and media, or "
                 "something else? Answer with the category and a reason."),
    "example": ("Write a short example that uses the API documented above, with comments.",
                "Show how to call this in a small Python script, and explain the output."),
}
LONG_INSTRUCTIONS = {
    "summarise": ("Summarise the document above in one paragraph.",
                  "Write a summary of this document with one bullet point per section."),
    "question": ("Read the document above. What are the three most important things a new "
                 "user should know? Answer briefly.",
                 "Based on the document above, how would someone get started, step by step?"),
}
COMPOSE_INSTRUCTIONS = {
    "story": ("Write a short story about {}.", "Tell a short story about {}, with a happy "
              "ending."),
    "letter": ("Write a short letter to a friend about {}.",
               "Write a friendly email describing {} to a colleague."),
    "poem": ("Write a short poem about {}.", "Write a poem of three short verses about {}."),
    "advice": ("I am writing about {}. Give me five tips to make the piece vivid.",
               "Give practical advice to someone who wants to write about {}."),
    "brainstorm": ("Brainstorm ten ideas for a short film about {}.",
                   "List eight questions a curious child might ask about {}."),
    "dialogue": ("Write a short dialogue between two people about {}.",),
    "description": ("Describe {} in one vivid paragraph.",
                    "Describe {} for a travel or lifestyle blog, in about 150 words."),
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


def sections(text: str, low: int, high: int, rng: random.Random) -> List[str]:
    """Consecutive stretches of `text`, each of whole paragraphs (blank-line separated) and
    about rng.randint(low, high) characters; a paragraph longer than `high` is cut at a line;
    a tail shorter than low / 2 is dropped."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    out, cur, size, goal = [], [], 0, rng.randint(low, high)
    for para in paragraphs:
        if len(para) > high:
            para = para[:para.rfind("\n", 0, high)] if "\n" in para[:high] else para[:high]
        cur.append(para)
        size += len(para) + 2
        if size >= goal:
            out.append("\n\n".join(cur))
            cur, size, goal = [], 0, rng.randint(low, high)
    if cur and size >= low // 2:
        out.append("\n\n".join(cur))
    return out


def _documentation_prompts(source: str):
    """The prompt builder of a documentation source (pydoc, debdoc, man): each document cut
    into sections, the kinds in rotation; a document in LONG_SHARE (long enough) is cut into
    long stretches instead, to summarise or question (in rotation)."""
    def build(docs: List[dict], rng: random.Random) -> List[Prompt]:
        out: List[Prompt] = []
        kinds = KINDS[source]
        for doc in docs:
            text = data.document_text(doc)
            if not text:
                continue
            long = len(text) >= LONG_CHARS[0] and rng.random() < LONG_SHARE
            for part in sections(text, *(LONG_CHARS if long else SECTION_CHARS), rng):
                if long and len(part) >= LONG_CHARS[0] // 2:
                    kind = LONG_KINDS[sum(p.kind in LONG_KINDS for p in out) % len(LONG_KINDS)]
                    instruction = rng.choice(LONG_INSTRUCTIONS[kind.removeprefix("long_")])
                else:
                    kind = kinds[len(out) % len(kinds)]
                    instruction = rng.choice(DOC_INSTRUCTIONS[kind])
                user = (f"{part}\n\n{instruction}" if rng.random() < 0.8
                        else f"{instruction}\n\n{part}")
                out.append(Prompt(source, doc["name"], kind, user, rng.choice(FOLLOWUPS["docs"])))
        return out
    return build


COMPOSE_STYLES = ("", " Keep it under 120 words.", " Write it for a ten-year-old.",
                  " Use a warm, personal tone.", " Make it funny.", " Use a formal tone.",
                  " Include at least one surprising detail.", " Write it in the first person.")


def _compose_prompts(docs: List[dict], rng: random.Random) -> List[Prompt]:
    """Every subject in every form, three times with different styles (`COMPOSE_STYLES`; one
    phrasing drawn each time)."""
    return [Prompt("compose", doc["name"], form,
                   rng.choice(COMPOSE_INSTRUCTIONS[form]).format(data.document_text(doc))
                   + style, rng.choice(FOLLOWUPS["compose"]))
            for doc in docs for form in KINDS["compose"]
            for style in rng.sample(COMPOSE_STYLES, 3)]


BUILDERS = {"kjv": _kjv_prompts, "champ": _champ_prompts, "humaneval": _humaneval_prompts,
            "stdlib": _stdlib_prompts, "pydoc": _documentation_prompts("pydoc"),
            "debdoc": _documentation_prompts("debdoc"), "man": _documentation_prompts("man"),
            "compose": _compose_prompts}


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
