"""A self-distilled corpus: the target's own responses to prompts built from sharpdraft's sources.

Drafters are judged by agreement with the target, so they should be trained on what the target
says. `generate_corpus` answers a deterministic prompt set (`prompts.build_prompts`) with the
target, batched (`sharpdraft.inference.batched.generate_batch`: one forward per step for the
whole batch, left padding), and appends the token ids to shards in the format of `shards`
(`shards.load` reads a split back; also reachable here as `load`). Each shard is written, then
the manifest is rewritten; a run resumes after the last shard the manifest lists.

Per shard: `batches_per_shard` batches of first turns, then one batch of follow-ups (a second
user turn after the target's first response): the `batch` shortest such conversations that fit
(so they lean to the shorter prompts); a follow-up's response mask covers the second response
only (the first is stored with its own prompt).
"""
from __future__ import annotations

import hashlib
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._hashing import sha256_files
from ..inference.batched import generate_batch
from ..inference.sampling import sample_next
from . import sources as data
from .prompts import FOLLOWUP, KINDS, Prompt, build_prompts, pad_id, prompts_digest, render
from .shards import (FORMAT, MANIFEST, Corpus, load, read_manifest, read_shard,
                     remove_temporaries, write_manifest, write_shard)

# what callers reach as `corpus.<name>`: this module's own names, and those of the layers the
# corpus is made with (prompts, shards, batched generation, sampling)
__all__ = ["FORMAT", "KINDS", "MANIFEST", "RESCHEDULABLE", "Corpus", "Prompt", "Settings",
           "batch_seed", "build_prompts", "generate_batch", "generate_corpus", "load", "pad_id",
           "prompts_digest", "read_manifest", "read_shard", "render", "sample_next",
           "shard_split", "target_sha256", "write_shard"]


# ----- settings -----------------------------------------------------------------------------------
@dataclass
class Settings:
    """What fixes a corpus's content: a resumed run must use the same values, except the
    schedule (`RESCHEDULABLE`: batch, batches_per_shard), which may change from one run to the
    next; every shard records the schedule it was made with.

    A shard is `batches_per_shard` batches of `batch` first-turn prompts (sorted by length within
    the shard, to pad little) plus one batch of up to `batch` follow-ups (the shortest); every
    `sample_every`-th batch samples (temperature, top_p), the others are greedy. Shard k belongs
    to the held-out split when k % heldout_every == heldout_every // 2 (0: no held-out shards).
    A prompt whose ids plus max_new_tokens exceed max_seq_len is skipped. A corpus made before
    a field existed is resumed without comparing it.
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
    weights: str = "dense"      # the target's linear weights (`load_target(weights=...)`)


RESCHEDULABLE = ("batch", "batches_per_shard")   # how prompts are grouped, not what they are


def shard_split(k: int, settings: Settings) -> str:
    """The split of global shard index k."""
    every = settings.heldout_every
    return "heldout" if every and k % every == every // 2 else "train"


def batch_seed(seed: int, k: int, j: int) -> int:
    """The sampling seed of batch j of shard k."""
    return zlib.crc32(f"{seed}-{k}-{j}".encode()) & 0x7FFFFFFF


# ----- generation ---------------------------------------------------------------------------------
def target_sha256(provenance: dict) -> Optional[str]:
    """The target's sha256: the provenance's (GGUF source), else that of a checkpoint folder's
    weight files (*.safetensors then *.bin, each sorted by name, concatenated); None when it
    has neither."""
    if provenance.get("sha256"):
        return provenance["sha256"]
    src = Path(provenance.get("source", ""))
    if not src.is_dir():
        return None
    files = sorted(src.glob("*.safetensors")) + sorted(src.glob("*.bin"))
    return sha256_files(*files) if files else None


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


def _check_resume(manifest: dict, settings: Settings, sha: Optional[str], out: Path) -> None:
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


def prompt_key(p: Prompt) -> str:
    """A short digest of a prompt's first user turn: which prompts a corpus already holds,
    whatever prompt set they came from."""
    return hashlib.sha256(p.user.encode()).hexdigest()[:16]


def resume_points(manifest: dict, prompt_sets: dict) -> Tuple[Dict[str, int], Dict[str, set]]:
    """({split: position in this machine's prompt set to go on from}, {split: keys of the
    prompts to skip}).

    A split's shards record the digest of the prompt set they were drawn from ("prompt_set";
    shards of older corpora: the manifest's first one). While this machine builds the same set,
    generation goes on after the last shard's prompts. Where it differs (the documentation and
    manual pages a machine has differ), this machine's set starts from its beginning, and every
    prompt the corpus already holds (`prompt_key`; records without a key: the same source,
    document and kind) is skipped; the change is said on stderr and recorded in the manifest's
    "prompt_set_history"."""
    cursor = {s: 0 for s in data.SPLITS}
    done: Dict[str, set] = {s: set() for s in data.SPLITS}
    other: Dict[str, bool] = {s: False for s in data.SPLITS}   # shards from another set
    for shard in manifest["shards"]:
        split = shard["split"]
        digest = shard.get("prompt_set", manifest["prompt_sets"][split]["sha256"])
        same = digest == prompt_sets[split]["sha256"]
        cursor[split] = shard["prompt_range"][1] if same else 0
        other[split] |= not same
        for r in shard["sequences"]:
            done[split].add(r.get("key") or (r["source"], r["doc"], r["kind"]))
    history = manifest.setdefault("prompt_set_history", [])
    for split in data.SPLITS:
        if not other[split]:
            done[split] = set()          # one set throughout: its order says what is done
            continue
        new = prompt_sets[split]["sha256"]
        if not any(h["split"] == split and h["sha256"] == new for h in history):
            print(f"sharpdraft: the {split} prompt set differs from the one this corpus was "
                  f"generated from so far (this machine's documentation or packages differ): "
                  f"going on with this machine's set, skipping the {len(done[split])} prompts "
                  f"the corpus holds", file=sys.stderr)
            history.append({"split": split, "sha256": new, "from_shard": len(manifest["shards"]),
                            "info": prompt_sets[split]})
    return cursor, done


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
        model: a causal LM, or a `sharpdraft.target.TargetRuntime` prepared from one
            (`batched.generate_batch` takes either; a bare model is left as it is).
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
    remove_temporaries(out)
    provenance = dict(provenance or {})
    sets = {s: build_prompts(s, settings.seed, sources, documents) for s in data.SPLITS}
    prompt_sets = {s: _prompt_set_info(*sets[s]) for s in data.SPLITS}
    manifest = read_manifest(out)
    if manifest is None:
        manifest = _new_manifest(settings, provenance, tokenizer, prompt_sets)
    else:
        _check_resume(manifest, settings, target_sha256(provenance), out)
    cursor, skip = resume_points(manifest, prompt_sets)
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
                                    settings, manifest, bar if split == "train" else None,
                                    skip[split])
            shard["prompt_set"] = prompt_sets[split]["sha256"]
            cursor[split] = shard["prompt_range"][1]
            _record_shard(manifest, shard)
            write_manifest(out, manifest)
            written += 1
            tp = manifest["throughput"]
            bar.set_postfix(tok_s=f"{tp['response_tokens_per_s']:.0f}",
                            heldout=manifest["counts"]["heldout"]["response_tokens"])
    finally:
        bar.close()
    return manifest


def _generate_shard(model, tokenizer, out: Path, k: int, split: str, prompts: List[Prompt],
                    start: int, settings: Settings, manifest: dict, bar,
                    done: Optional[set] = None) -> dict:
    """Generate and write shard k (first turns, then follow-ups); returns its manifest entry
    (without counts merged). Prompts whose key is in `done` are passed over in the set's first
    pass (`resume_points`)."""
    done = done if done is not None else set()
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
        if i < len(prompts) and (prompt_key(p) in done or (p.source, p.doc, p.kind) in done):
            i += 1
            continue
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
                        "turns": 1, "batch": batch_of[c], "key": prompt_key(p)})
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
                            "first_kind": p.kind, "turns": 2, "batch": j,
                            "key": prompt_key(p)})
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
