"""Held-out multi-turn sessions that grow to the target's context (`sharpdraft bench --suite
sessions`): each turn's answer stays in the context, as in a chat. None of the text was ever in a
corpus or a training run:

- documents: licence texts from /usr/share/common-licenses (held out from every corpus), each
  cut to about `DOC_TOKENS` tokens, with a question on it and a follow-up question;
- maths: the held-out champ-dataset problems (`sources.CHAMP_HELD_OUT`): the second half pasted
  with their solutions as course notes, then the first half asked one after another, each
  answer followed by a request to check it;
- reading: the held-out book of Genesis (`sources.KJV_HELD_OUT_BOOKS`) read chapter by chapter,
  each with a request and a follow-up question (a long chat about a long text).

`Conversation` turns a session's user messages into token ids through the target's own chat
template (the template renders the history; only what follows the last answer is appended), and
ends the session before a turn would pass the context limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

SESSIONS = ("documents", "maths", "reading")
DOC_TOKENS = 1100                     # tokens a licence text is cut to
DOC_QUESTIONS = (
    ("Apache-2.0", "What does this licence require of someone who redistributes the work?"),
    ("MPL-2.0", "Summarise the main conditions of this document as five bullet points."),
    ("GPL-2", "Explain in plain words what a person who modifies this program must do."),
    ("GFDL-1.3", "What is this document about, and who is it meant for?"),
    ("LGPL-2.1", "How does this licence treat a program that only links to the library?"),
    ("GPL-3", "List the obligations this text places on someone who conveys the work."),
    ("CC0-1.0", "What rights does the author give up, and what is kept?"),
)
DOC_FOLLOW_UPS = ("Which of these points matters most to a small company, and why?",
                  "How does this compare with the previous document?")
READING_REQUESTS = ("Retell this chapter in plain modern words.",
                    "Who are the people in this chapter, and what does each of them do?",
                    "What happens in this chapter that matters for the rest of the story?")
READING_FOLLOW_UP = "What did you find most surprising in it, and why?"
MATHS_CHECK = "Check that answer another way, briefly."


@dataclass(frozen=True)
class Session:
    """One session: `name` and its user messages in order."""

    name: str
    turns: Tuple[str, ...]


def _check(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in SESSIONS]
    if unknown:
        raise ValueError(f"--sessions: unknown {list(unknown)}; known: {list(SESSIONS)}")


def documents(tokenizer) -> Session:
    """Licence documents, a question on each and a follow-up."""
    from .tasks import cut_document

    turns = []
    for i, (name, question) in enumerate(DOC_QUESTIONS):
        turns.append(f"{cut_document(tokenizer, name, DOC_TOKENS)}\n\n{question}")
        turns.append(DOC_FOLLOW_UPS[i % len(DOC_FOLLOW_UPS)])
    return Session("documents", tuple(turns))


def maths() -> Session:
    """Held-out champ problems: half of them as worked notes, the other half one by one, each
    answer checked in the next turn.

    Raises:
        ModuleNotFoundError saying how to install it: champ-dataset is absent.
    """
    from .tasks import held_out_problems

    problems = held_out_problems("the maths session")
    half = len(problems) // 2
    notes = "\n\n".join(f"Problem: {p['problem']}\nSolution: {p['solution']}"
                        for p in problems[half:])
    first = (f"Here are worked examples from my course notes:\n\n{notes}\n\nNow solve this "
             f"one step by step, in the same way:\n{problems[0]['problem']}")
    turns = [first]
    for p in problems[1:half]:
        turns += [MATHS_CHECK, f"Next problem:\n{p['problem']}\nSolve it step by step."]
    return Session("maths", tuple(turns + [MATHS_CHECK]))


def _genesis_chapters() -> List[str]:
    from . import sources
    chapters: dict = {}
    for book, ref, text in sources.kjv_verses():
        if book == "Ge":
            chapters.setdefault(ref[2:].split(":")[0], []).append(text)
    return [" ".join(v) for v in chapters.values()]


def reading() -> Session:
    """Genesis chapter by chapter, a request on each and a follow-up question."""
    turns = []
    for i, chapter in enumerate(_genesis_chapters()[:12]):
        opener = ("Here is the first chapter of a book I am reading:" if i == 0
                  else "Here is the next chapter:")
        turns.append(f"{opener}\n\n{chapter}\n\n{READING_REQUESTS[i % len(READING_REQUESTS)]}")
        turns.append(READING_FOLLOW_UP)
    return Session("reading", tuple(turns))


def sessions(tokenizer, names: Sequence[str] = SESSIONS) -> List[Session]:
    """The named sessions (default all, in `SESSIONS` order).

    Raises:
        ValueError: an unknown name.
        ModuleNotFoundError / FileNotFoundError: champ-dataset or a licence text is missing.
    """
    _check(names)
    build = {"documents": lambda: documents(tokenizer), "maths": maths, "reading": reading}
    return [build[n]() for n in SESSIONS if n in names]


class Conversation:
    """A session's token ids for `engine.speculative_chat` / `autoregressive_chat`: `first` (the
    first user message in the chat template, with the generation prompt) and `follow_up`, which
    renders the history with the next message and returns what follows the last answer (the end
    of the assistant message, the user message, the generation prompt). It ends the session
    (None) when the messages run out or the next turn and its answer would pass
    `max_context` - `margin` positions.

    `answers` and `turn_ids` record what was said, `contexts` the context before each answer.
    """

    def __init__(self, tokenizer, session: Session, max_new_tokens: int, max_context: int,
                 margin: int = 32):
        self.tokenizer, self.session = tokenizer, session
        self.max_new_tokens, self.max_context, self.margin = max_new_tokens, max_context, margin
        ids = tokenizer.apply_chat_template([{"role": "user", "content": session.turns[0]}],
                                            add_generation_prompt=True, return_dict=False)
        self.first = torch.tensor([list(ids)])
        self.turn_ids: List[List[int]] = [list(ids)]
        self.answers: List[List[int]] = []
        self.contexts: List[int] = [len(ids)]
        if self.contexts[0] + max_new_tokens + margin > max_context:
            raise ValueError(f"session {session.name}: its first turn ({len(ids)} tokens) and "
                             f"--max-new-tokens {max_new_tokens} pass the context "
                             f"{max_context}")

    def _tail(self, answer_text: str, message: str) -> List[int]:
        """Ids of what the template puts after an assistant message `answer_text` up to the
        next generation prompt."""
        chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": answer_text}]
        before = self.tokenizer.apply_chat_template(chat, tokenize=False)
        full = self.tokenizer.apply_chat_template(chat + [{"role": "user", "content": message}],
                                                  tokenize=False, add_generation_prompt=True)
        cut = before.rindex(answer_text) + len(answer_text)
        return self.tokenizer(full[cut:], add_special_tokens=False)["input_ids"]

    def follow_up(self, turn: int, answer: List[int]) -> Optional[torch.Tensor]:
        self.answers.append(list(answer))
        if turn + 1 >= len(self.session.turns):
            return None
        tail = self._tail("A", self.session.turns[turn + 1])
        eos = self.tokenizer.eos_token_id
        if answer and answer[-1] == eos and tail and tail[0] == eos:
            tail = tail[1:]                    # the answer's EOS already closed the message
        context = self.contexts[-1] + len(answer) + len(tail)
        if context + self.max_new_tokens + self.margin > self.max_context:
            return None
        self.turn_ids.append(tail)
        self.contexts.append(context)
        return torch.tensor([tail])

    def transcript(self) -> List[int]:
        """Every id of the session so far: turns and answers interleaved."""
        out: List[int] = []
        for i, ids in enumerate(self.turn_ids):
            out += ids
            if i < len(self.answers):
                out += self.answers[i]
        return out
