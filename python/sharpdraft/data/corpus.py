"""A self-distilled corpus: the target's own responses to prompts built from sharpdraft's sources.

Drafters are judged by agreement with the target, so they should be trained on what the target
says. `generate_corpus` answers a deterministic prompt set (see `build_prompts`) with the target,
batched (one forward per step for the whole batch, transformers' `generate`, left padding), and
appends the token ids to shards:

    DIR/manifest.json              what was generated, how, and from what (rewritten atomically)
    DIR/train/shard_00000.npz      the train split's sequences
    DIR/heldout/shard_00000.npz    the held-out split's (documents never in train)

A shard holds whole sequences (prompt + response) as flat arrays (`np.savez_compressed`):
``tokens`` (uint16 when the vocabulary fits, else int32), ``response_mask`` (uint8, 1 on the
tokens the target generated), ``offsets`` (int64, sequence i is ``tokens[offsets[i]:offsets[i+1]]``)
and ``prompt_index`` (int32, the prompt's position in its split's prompt order). Each shard is
written under a temporary name and renamed, then the manifest is rewritten (temporary + rename):
a crash leaves at most a stray temporary file and an unlisted shard, both ignored and redone on
the next run, which resumes after the last shard the manifest lists.

Prompt set: every split's prompts come only from that split's documents of `sharpdraft.data`
(held out: Genesis, the first champ problems, about one in ten HumanEval tasks and stdlib files),
so no held-out document ever reaches train. Kinds of prompt, per source:

* kjv: a passage (about 100-650 tokens) with an instruction: summarise, list, explain,
  continue, or a question;
* champ: a problem to solve step by step (two phrasings each);
* humaneval: complete the function, or explain it;
* stdlib: one function: explain it, document it (its docstring removed), or find the bug (one
  operator flipped);
* followup: a second user turn after the target's first response: per shard, the `batch`
  shortest such conversations that fit (so they lean to the shorter prompts); its response
  mask covers the second response only (the first is stored with its own prompt).

Read a corpus back with `load(DIR, split)`.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import io
import json
import os
import random
import textwrap
import time
import tokenize
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import sources as data

FORMAT = "sharpdraft-corpus/1"
MANIFEST = "manifest.json"
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

# ----- instructions ---------------------------------------------------------------------------------
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
MUTATIONS = {"<": "<=", ">": ">=", "<=": "<", ">=": ">", "==": "!=", "!=": "==", "+": "-",
             "-": "+", "and": "or", "or": "and", "True": "False", "False": "True"}


# ----- the prompt set ---------------------------------------------------------------------------------
@dataclass
class Prompt:
    """One prompt: `user` is the first user message, `followup` the second user turn used when
    this prompt is chosen for a follow-up. `doc` names the data.py document it comes from."""

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


def _functions(source: str) -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """(dedented source, docstring line span relative to it or None) of every function in a
    module's source whose size lies within FUNCTION_CHARS; [] when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if not FUNCTION_CHARS[0] <= len(text) <= FUNCTION_CHARS[1]:
            continue
        first = node.body[0]
        doc_span = None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str) and len(node.body) > 1):
            doc_span = (first.lineno - node.lineno, first.end_lineno - node.lineno + 1)
        out.append((text, doc_span))
    return out


def _mutate(code: str, rng: random.Random) -> Optional[str]:
    """`code` with one operator / boolean flipped (MUTATIONS), or None when it has none."""
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type in (tokenize.OP, tokenize.NAME) and t.string in MUTATIONS
                and t.start[0] == t.end[0]]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    if not toks:
        return None
    t = rng.choice(toks)
    lines = code.split("\n")
    row, col = t.start[0] - 1, t.start[1]
    line = lines[row]
    lines[row] = line[:col] + MUTATIONS[t.string] + line[t.end[1]:]
    return "\n".join(lines)


def _stdlib_prompts(docs: List[dict], rng: random.Random) -> List[Prompt]:
    """Every function of FUNCTION_CHARS size: explain, document (docstring removed) or find the
    bug (one token of MUTATIONS flipped), in rotation; explain where the kind does not apply."""
    out = []
    for doc in docs:
        module = doc["name"][:-3].replace("/", ".").replace(".__init__", "")
        for code, doc_span in _functions(data.document_text(doc)):
            kind = KINDS["stdlib"][len(out) % 3]
            if kind == "document" and doc_span is not None:
                lines = code.split("\n")
                body = "\n".join(lines[:doc_span[0]] + lines[doc_span[1]:])
                user = (f"Write a docstring for this function from the Python standard library "
                        f"module `{module}`.\n\n```python\n{body}\n```")
            elif kind == "find_bug" and (bad := _mutate(code, rng)) is not None:
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
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(asdict(p), sort_keys=True).encode())
    return h.hexdigest()


# ----- rendering and batched generation ------------------------------------------------------------
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


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: Optional[torch.Generator], candidates: int = 64) -> torch.Tensor:
    """Next token ids (B,) from last-row logits (B, V): argmax when temperature is 0, else a
    draw from softmax(logits / temperature) restricted to the smallest set of most likely
    tokens whose probability reaches `top_p` (nucleus; the most likely token always stays).

    The nucleus is searched among the `candidates` most likely tokens first; a row whose
    nucleus is larger takes the full sort, so the distribution is exactly the nucleus one."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    k = probs.shape[-1] if top_p >= 1.0 else min(candidates, probs.shape[-1])
    kept, order = probs.topk(k, dim=-1)
    if top_p < 1.0 and not bool((kept.sum(-1) >= top_p).all()):
        kept, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        kept = kept.masked_fill(kept.cumsum(-1) - kept >= top_p, 0.0)
    pick = torch.multinomial(kept, 1, generator=generator)
    return order.gather(-1, pick).squeeze(-1)


def _take_rows(cache, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` of every layer of a PreallocatedCache (a new, smaller
    buffer per layer; done only when enough rows have finished to pay for the copy)."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.key_buffer = layer.key_buffer.index_select(0, rows)
            layer.value_buffer = layer.value_buffer.index_select(0, rows)
            layer._views()


@torch.no_grad()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   pad_token_id: int, eos_token_id: Optional[int], temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> List[List[int]]:
    """The model's responses to a batch of prompts: one forward per step for the whole batch,
    prompts left-padded with `pad_token_id` (masked out; position ids count real tokens only),
    keys and values in a `sharpdraft.target.PreallocatedCache` sized for the whole batch, and
    rows that reached EOS dropped from the batch once a quarter of it has finished.

    Args:
        prompts: B token-id lists (lengths may differ, each >= 1).
        temperature: 0 for greedy; else sampling at this temperature with nucleus `top_p`
            (`sample_next`), from a torch.Generator seeded with `seed`.

    Returns:
        B lists of generated ids, each cut after its first `eos_token_id` (kept) or at
        `max_new_tokens`.
    """
    from ..target.kv_cache import PreallocatedCache

    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("prompts: need at least one prompt, each with at least one token")
    width = max(len(p) for p in prompts)
    n = len(prompts)
    device = next(model.parameters()).device
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width + max_new_tokens), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):width] = 1
    ids, mask = ids.to(device), mask.to(device)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    cache = PreallocatedCache(model.config.num_hidden_layers, width + max_new_tokens)
    out: List[List[int]] = [[] for _ in range(n)]
    live = list(range(n))                  # the prompt index of each batch row
    finished = [False] * n
    step_ids, seen = ids, width            # this forward's input ids; positions after it
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    for t in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=mask[:, :seen], position_ids=pos,
                       cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        nxt = sample_next(logits, temperature, top_p, generator)
        keep = []
        for r, (i, tok) in enumerate(zip(live, nxt.tolist())):
            if not finished[i]:
                out[i].append(tok)
                finished[i] = tok == eos_token_id
            if not finished[i]:
                keep.append(r)
        if not keep or t == max_new_tokens - 1:
            break
        if len(keep) <= 0.75 * len(live):      # compact: drop the finished rows
            rows = torch.tensor(keep, device=device)
            _take_rows(cache, rows)
            mask, nxt, pos = mask.index_select(0, rows), nxt.index_select(0, rows), pos[rows]
            live = [live[r] for r in keep]
        mask[:, seen] = 1
        seen += 1
        step_ids, pos = nxt[:, None], pos[:, -1:] + 1
    return out


# ----- settings, shards and the manifest ----------------------------------------------------------
@dataclass
class Settings:
    """What fixes a corpus's content: a resumed run must use the same values, except the
    schedule (`RESCHEDULABLE`: batch, batches_per_shard), which may change from one run to the
    next; every shard records the schedule it was made with.

    A shard is `batches_per_shard` batches of `batch` first-turn prompts (sorted by length within
    the shard, to pad little) plus one batch of up to `batch` follow-ups (the shortest); every `sample_every`-th
    batch samples (temperature, top_p), the others are greedy. Shard k belongs to the held-out
    split when k % heldout_every == heldout_every // 2 (0: no held-out shards). A prompt whose
    ids plus max_new_tokens exceed max_seq_len is skipped.
    """

    batch: int = 16
    max_new_tokens: int = 256
    seed: int = 0
    batches_per_shard: int = 4
    temperature: float = 0.7
    top_p: float = 0.8
    sample_every: int = 2
    heldout_every: int = 20
    max_seq_len: int = 1024
    dtype: str = "float32"


RESCHEDULABLE = ("batch", "batches_per_shard")   # how prompts are grouped, not what they are


def shard_split(k: int, settings: Settings) -> str:
    """The split of global shard index k."""
    every = settings.heldout_every
    return "heldout" if every and k % every == every // 2 else "train"


def batch_seed(seed: int, k: int, j: int) -> int:
    """The sampling seed of batch j of shard k."""
    return zlib.crc32(f"{seed}-{k}-{j}".encode()) & 0x7FFFFFFF


def _atomic_write(path: Path, write: Callable) -> None:
    """write(file) into `.<name>.tmp-<pid>` beside `path`, fsync, then rename onto `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_temporaries(out: Path) -> None:
    for tmp in list(out.glob(".*.tmp-*")) + list(out.glob("*/.*.tmp-*")):
        tmp.unlink(missing_ok=True)


def write_shard(path: Path, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[int]],
                prompt_index: Sequence[int], vocab_size: int) -> None:
    """One shard (see the module docstring), written atomically.

    Raises:
        ValueError: a mask whose length differs from its sequence's.
    """
    for s, m in zip(sequences, masks):
        if len(s) != len(m):
            raise ValueError(f"write_shard: mask of {len(m)} for a sequence of {len(s)} tokens")
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    arrays = {
        "tokens": np.concatenate([np.asarray(s, dtype=dtype) for s in sequences]),
        "response_mask": np.concatenate([np.asarray(m, dtype=np.uint8) for m in masks]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "prompt_index": np.asarray(prompt_index, dtype=np.int32)}
    _atomic_write(path, lambda f: np.savez_compressed(f, **arrays))


def read_shard(path: Path) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """(sequences: int64 arrays, masks: bool arrays) of one shard file."""
    with np.load(path) as z:
        tokens, mask, off = z["tokens"].astype(np.int64), z["response_mask"], z["offsets"]
    return ([tokens[a:b] for a, b in zip(off[:-1], off[1:])],
            [mask[a:b].astype(bool) for a, b in zip(off[:-1], off[1:])])


def read_manifest(out: Path) -> Optional[dict]:
    path = Path(out) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def _write_manifest(out: Path, manifest: dict) -> None:
    text = (json.dumps(manifest, indent=1) + "\n").encode()
    _atomic_write(Path(out) / MANIFEST, lambda f: f.write(text))


@dataclass
class Corpus:
    """A split of a corpus: sequences[i] (int64, prompt + response ids), masks[i] (bool, same
    length, True on response tokens) and records[i] (source, doc, kind, turns, shard, batch,
    temperature, top_p, seed of its batch)."""

    sequences: List[np.ndarray]
    masks: List[np.ndarray]
    records: List[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sequences)


def load(out, split: str = "train") -> Corpus:
    """The sequences of `split` in the shards the manifest of folder `out` lists, in order.

    Raises:
        FileNotFoundError: no manifest in `out`.
        ValueError: unknown split, or a shard that disagrees with the manifest.
    """
    if split not in data.SPLITS:
        raise ValueError(f"split must be one of {data.SPLITS}, got {split!r}")
    manifest = read_manifest(Path(out))
    if manifest is None:
        raise FileNotFoundError(f"{out}: no {MANIFEST} (not a corpus folder)")
    corpus = Corpus([], [], [])
    for shard in manifest["shards"]:
        if shard["split"] != split:
            continue
        seqs, masks = read_shard(Path(out) / shard["file"])
        if len(seqs) != len(shard["sequences"]):
            raise ValueError(f"{shard['file']}: {len(seqs)} sequences, the manifest lists "
                             f"{len(shard['sequences'])}")
        batches = {b["batch"]: b for b in shard["batches"]}
        corpus.sequences.extend(seqs)
        corpus.masks.extend(masks)
        for rec in shard["sequences"]:
            b = batches[rec["batch"]]
            corpus.records.append(dict(rec, shard=shard["index"], temperature=b["temperature"],
                                       top_p=b["top_p"], seed=b["seed"]))
    return corpus


# ----- generation ---------------------------------------------------------------------------------------
def _weights_sha256(folder: Path) -> Optional[str]:
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def target_sha256(provenance: dict) -> Optional[str]:
    """The target's sha256: the provenance's (GGUF source), else of a checkpoint folder's weights."""
    if provenance.get("sha256"):
        return provenance["sha256"]
    src = Path(provenance.get("source", ""))
    return _weights_sha256(src) if src.is_dir() else None


SPLIT_RULE = {"train": "every document of sharpdraft.data's train split (documents(source, "
                       "'train'))",
              "heldout": f"sharpdraft.data's held-out documents: KJV books "
                         f"{list(data.KJV_HELD_OUT_BOOKS)}, the first {data.CHAMP_HELD_OUT} champ "
                         f"problems, HumanEval tasks and stdlib files whose crc32(name) % 10 == 0"}


def _new_manifest(settings: Settings, provenance: dict, tokenizer, prompt_sets: dict) -> dict:
    return {"format": FORMAT,
            "target": dict(provenance, sha256=target_sha256(provenance)),
            "tokenizer": {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                          "pad_token_id": pad_id(tokenizer),
                          "chat_template": bool(getattr(tokenizer, "chat_template", None))},
            "settings": asdict(settings),
            "prompt_sets": prompt_sets,
            "splits": {s: {"rule": SPLIT_RULE[s], "documents": {}} for s in data.SPLITS},
            "counts": {s: {"sequences": 0, "prompts": 0, "followups": 0, "prompt_tokens": 0,
                           "response_tokens": 0, "skipped_too_long": 0} for s in data.SPLITS},
            "throughput": {"generate_s": 0.0, "response_tokens": 0, "response_tokens_per_s": None},
            "shards": []}


def _check_resume(manifest: dict, settings: Settings, sha: Optional[str], prompt_sets: dict,
                  out: Path) -> None:
    """Raise ValueError naming the first setting (as a flag) that differs from the corpus's."""
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{out}: manifest format {manifest.get('format')!r}, expected {FORMAT}")
    for key, old in manifest["settings"].items():
        if key in RESCHEDULABLE:
            continue
        new = getattr(settings, key, None)
        if new != old:
            raise ValueError(f"--{key.replace('_', '-')} {new}: {out} was generated with "
                             f"{old}; rerun with the same value or use another --out")
    if manifest["target"].get("sha256") != sha:
        raise ValueError(f"--target: {out} was generated by a target with sha256 "
                         f"{manifest['target'].get('sha256')}, this one is {sha}")
    for split, info in prompt_sets.items():
        if manifest["prompt_sets"][split]["sha256"] != info["sha256"]:
            raise ValueError(f"{out}: the {split} prompt set differs from the one it was "
                             f"generated from (sources changed?); use another --out")


def _prompt_set_info(prompts: List[Prompt], unavailable: List[str]) -> dict:
    by = {}
    for p in prompts:
        by[f"{p.source}/{p.kind}"] = by.get(f"{p.source}/{p.kind}", 0) + 1
    return {"prompts": len(prompts), "sha256": prompts_digest(prompts),
            "by_source_kind": dict(sorted(by.items())), "unavailable_sources": unavailable}


def _fits(ids: Sequence[int], settings: Settings) -> bool:
    return len(ids) + settings.max_new_tokens <= settings.max_seq_len


def generate_corpus(model, tokenizer, out, tokens: int, settings: Settings = Settings(), *,
                    provenance: Optional[dict] = None, max_shards: Optional[int] = None,
                    sources: Sequence[str] = data.SOURCES,
                    documents: Optional[Callable[[str, str], List[dict]]] = None,
                    progress: bool = True) -> dict:
    """Generate (or continue) the corpus in folder `out` until its train split holds at least
    `tokens` response tokens.

    Args:
        model: a causal LM (prepared with `sharpdraft.target.prepare_target` for speed on CPU).
        tokenizer: its tokenizer (chat template used when it has one).
        settings: see `Settings`; must equal those of an existing corpus in `out`, except
            batch and batches_per_shard (`RESCHEDULABLE`), which apply to the new shards.
        provenance: the target's (from `load_target`), stored in the manifest.
        tokens: target count of train response tokens (checked after every whole shard).
        max_shards: stop after writing this many shards in this call (tests, time budgets).
        sources, documents: where prompts come from (default: every source of
            `sharpdraft.data.documents`; tests pass small documents).

    Returns:
        The manifest as written.

    Raises:
        ValueError: tokens < 1, or `out` holds a corpus made with other settings / target /
            prompts (the message names the flag).
        RuntimeError: every prompt of a split is too long for max_seq_len.
    """
    if tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(out)
    provenance = dict(provenance or {})
    sets = {s: build_prompts(s, settings.seed, sources, documents) for s in data.SPLITS}
    prompt_sets = {s: _prompt_set_info(*sets[s]) for s in data.SPLITS}
    manifest = read_manifest(out)
    if manifest is None:
        manifest = _new_manifest(settings, provenance, tokenizer, prompt_sets)
    else:
        _check_resume(manifest, settings, target_sha256(provenance), prompt_sets, out)
    cursor = {s: 0 for s in data.SPLITS}
    for shard in manifest["shards"]:
        cursor[shard["split"]] = shard["prompt_range"][1]
    from tqdm import tqdm
    done = manifest["counts"]["train"]["response_tokens"]
    bar = tqdm(total=tokens, initial=min(done, tokens), unit="tok", desc="response tokens",
               disable=not progress, dynamic_ncols=True)
    written = 0
    try:
        while manifest["counts"]["train"]["response_tokens"] < tokens:
            if max_shards is not None and written >= max_shards:
                break
            k = len(manifest["shards"])
            split = shard_split(k, settings)
            prompts = sets[split][0]
            if not prompts:
                raise RuntimeError(f"the {split} prompt set is empty")
            shard = _generate_shard(model, tokenizer, out, k, split, prompts, cursor[split],
                                    settings, manifest, bar if split == "train" else None)
            cursor[split] = shard["prompt_range"][1]
            _record_shard(manifest, shard)
            _write_manifest(out, manifest)
            written += 1
            tp = manifest["throughput"]
            bar.set_postfix(tok_s=f"{tp['response_tokens_per_s']:.0f}",
                            heldout=manifest["counts"]["heldout"]["response_tokens"])
    finally:
        bar.close()
    return manifest


def _generate_shard(model, tokenizer, out: Path, k: int, split: str, prompts: List[Prompt],
                    start: int, settings: Settings, manifest: dict, bar) -> dict:
    """Generate and write shard k (first turns, then follow-ups); returns its manifest entry
    (without counts merged)."""
    eos = tokenizer.eos_token_id
    pad = pad_id(tokenizer)
    want = settings.batch * settings.batches_per_shard
    chosen: List[Tuple[int, List[int]]] = []       # (prompt position, prompt ids)
    skipped, i = 0, start
    while len(chosen) < want:
        if i - start > 50 * want and not chosen:
            raise RuntimeError(f"{split}: no prompt fits --max-seq-len {settings.max_seq_len} "
                               f"with --max-new-tokens {settings.max_new_tokens}")
        p = prompts[i % len(prompts)]
        ids = render(tokenizer, [{"role": "user", "content": p.user}])
        if _fits(ids, settings):
            chosen.append((i, ids))
        else:
            skipped += 1
        i += 1
    end = i
    batches, records, seqs, masks, index = [], [], [], [], []
    gen_s = 0.0

    def run(j: int, items: List[Tuple[int, List[int]]], epoch_max: int) -> List[List[int]]:
        nonlocal gen_s
        sample = j % settings.sample_every == settings.sample_every - 1 or epoch_max > 0
        temp, top_p = (settings.temperature, settings.top_p) if sample else (0.0, 1.0)
        seed = batch_seed(settings.seed, k, j)
        t0 = time.perf_counter()
        resp = generate_batch(model, [ids for _, ids in items], settings.max_new_tokens,
                              pad_token_id=pad, eos_token_id=eos, temperature=temp, top_p=top_p,
                              seed=seed)
        wall = time.perf_counter() - t0
        gen_s += wall
        n_resp = sum(len(r) for r in resp)
        batches.append({"batch": j, "size": len(items), "temperature": temp, "top_p": top_p,
                        "seed": seed if sample else None, "padded_prompt_len":
                        max(len(ids) for _, ids in items), "prompt_tokens":
                        sum(len(ids) for _, ids in items), "response_tokens": n_resp,
                        "wall_s": round(wall, 3)})
        if bar is not None:
            bar.update(n_resp)
        return resp

    # first turns: sorted by length (little padding), `batch` at a time
    order = sorted(range(len(chosen)), key=lambda c: (len(chosen[c][1]), c))
    first: Dict[int, List[int]] = {}          # chosen index -> its response
    batch_of: Dict[int, int] = {}
    for j in range(settings.batches_per_shard):
        group = order[j * settings.batch:(j + 1) * settings.batch]
        items = [chosen[c] for c in group]
        resp = run(j, items, max(pos // len(prompts) for pos, _ in items))
        for c, r in zip(group, resp):
            first[c], batch_of[c] = r, j
    for c, (pos, ids) in enumerate(chosen):
        p = prompts[pos % len(prompts)]
        seqs.append(ids + first[c])
        masks.append([0] * len(ids) + [1] * len(first[c]))
        index.append(pos)
        records.append({"prompt": pos, "source": p.source, "doc": p.doc, "kind": p.kind,
                        "turns": 1, "batch": batch_of[c]})
    # follow-ups: the `batch` shortest two-turn conversations that fit (little padding)
    follow: List[Tuple[int, List[int]]] = []
    for c, (pos, ids) in enumerate(chosen):
        p = prompts[pos % len(prompts)]
        answer = tokenizer.decode(first[c], skip_special_tokens=True)
        ids2 = render(tokenizer, [{"role": "user", "content": p.user},
                                  {"role": "assistant", "content": answer},
                                  {"role": "user", "content": p.followup}])
        if _fits(ids2, settings):
            follow.append((pos, ids2))
    follow = sorted(follow, key=lambda it: (len(it[1]), it[0]))[:settings.batch]
    if follow:
        j = settings.batches_per_shard
        resp = run(j, follow, max(pos // len(prompts) for pos, _ in follow))
        for (pos, ids2), r in zip(follow, resp):
            p = prompts[pos % len(prompts)]
            seqs.append(ids2 + r)
            masks.append([0] * len(ids2) + [1] * len(r))
            index.append(pos)
            records.append({"prompt": pos, "source": p.source, "doc": p.doc, "kind": FOLLOWUP,
                            "first_kind": p.kind, "turns": 2, "batch": j})
    local = sum(1 for s in manifest["shards"] if s["split"] == split)
    rel = f"{split}/shard_{local:05d}.npz"
    (out / split).mkdir(exist_ok=True)
    write_shard(out / rel, seqs, masks, index, len(tokenizer))
    n_resp = sum(int(sum(m)) for m in masks)
    n_prompt = sum(len(m) - int(sum(m)) for m in masks)
    return {"file": rel, "split": split, "index": k, "prompt_range": [start, end],
            "batch": settings.batch, "batches_per_shard": settings.batches_per_shard,
            "skipped_too_long": skipped, "prompt_tokens": n_prompt, "response_tokens": n_resp,
            "generate_s": round(gen_s, 3),
            "response_tokens_per_s": round(n_resp / gen_s, 2) if gen_s > 0 else None,
            "threads": torch.get_num_threads(), "batches": batches, "sequences": records}


def _record_shard(manifest: dict, shard: dict) -> None:
    """Merge a written shard into the manifest's counts, documents and throughput."""
    split = shard["split"]
    c = manifest["counts"][split]
    c["sequences"] += len(shard["sequences"])
    c["prompts"] += sum(1 for r in shard["sequences"] if r["turns"] == 1)
    c["followups"] += sum(1 for r in shard["sequences"] if r["turns"] == 2)
    c["prompt_tokens"] += shard["prompt_tokens"]
    c["response_tokens"] += shard["response_tokens"]
    c["skipped_too_long"] += shard["skipped_too_long"]
    docs = manifest["splits"][split]["documents"]
    for r in shard["sequences"]:
        names = docs.setdefault(r["source"], [])
        if r["doc"] not in names:
            names.append(r["doc"])
            names.sort()
    tp = manifest["throughput"]
    tp["generate_s"] = round(tp["generate_s"] + shard["generate_s"], 3)
    tp["response_tokens"] += shard["response_tokens"]
    tp["response_tokens_per_s"] = (round(tp["response_tokens"] / tp["generate_s"], 2)
                                   if tp["generate_s"] > 0 else None)
    manifest["shards"].append(shard)
