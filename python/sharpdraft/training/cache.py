"""The feature cache: target forwards computed once per training sequence, memory-mapped.

A training sequence is either a packed run of raw text (`text_sequences`: every position is a
training target) or a conversation of the self-distilled corpus (`corpus_sequences`: the prompt
is context only, the target's response is trained on). One target forward per sequence gives

- ``ids`` (T,) int32: the tokens;
- ``feats`` (T, F * H) float16: the outputs of the target layers the drafters read, side by side;
- ``top_p`` / ``top_i`` (T, k) float16 / int32: the target's k most likely next tokens at each
  position (row t is the distribution of token t + 1) and their probabilities;
- ``trained`` (T,) bool: row t is a training target (token t + 1 is a response token, or any
  text token; never the last row).

Shards of `SHARD_SEQUENCES` sequences are stored flat (rows of every sequence one after another,
``offsets`` (n + 1,) int64 their boundaries, the cu_seqlens convention) as one ``.npy`` file per
field, opened memory-mapped, so a cache larger than memory trains without loading it. A shard is
written under temporary names and renamed, its ``offsets`` file last (a shard without it does not
exist); ``meta.json`` written after the last shard marks the cache complete. Building resumes at
the first missing shard, and a folder serves every list of sequences that extends (or shortens)
the one it was built for: a stored shard is kept when its ids and trained flags equal (or begin
with) the wanted shard's, so growing a corpus only computes the new conversations.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from ..data import sources as data
from ..target.runtime import captured_hidden_states

SHARD_SEQUENCES = 16
FIELDS = ("ids", "feats", "top_p", "top_i", "trained")
# meta fields that describe the list of sequences rather than how each one's features are made
LIST_FIELDS = ("tokens_per_source", "response_tokens", "response_tokens_per_kind", "fingerprint",
               "sequences", "rows")


def autocast_to(device_type: str, dtype: Optional[torch.dtype]):
    """`torch.autocast(device_type, dtype)`, or a context that changes nothing when dtype is
    None (the modules' own precision)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@torch.no_grad()
def compute_features(target, ids: torch.Tensor, layer_ids: List[int], topk: int,
                     rows_per_chunk: int = 1024, autocast: Optional[torch.dtype] = None):
    """One target forward over ids (n, L): (features float16 (n, L, F*H), top-k probs float16
    (n, L, k), top-k ids int32 (n, L, k)); position t's distribution predicts token t + 1.

    Only the layers read are kept (forward hooks, not output_hidden_states), and the LM head
    runs on `rows_per_chunk` rows at a time, so the full (n, L, vocab) logits never exist.
    autocast: run the forward under `torch.autocast` in this dtype (None: the target's own)."""
    last = len(target.get_decoder().layers)
    head = target.get_output_embeddings()
    with autocast_to(ids.device.type, autocast):
        with captured_hidden_states(target, [i + 1 for i in layer_ids] + [last]) as hidden:
            target.get_decoder()(input_ids=ids, use_cache=False)
        flat = hidden[last].reshape(-1, hidden[last].shape[-1])
        tops = [torch.softmax(head(flat[r:r + rows_per_chunk]).float(), dim=-1).topk(topk, dim=-1)
                for r in range(0, flat.shape[0], rows_per_chunk)]
    feats = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1).float()
    p = torch.cat([t.values for t in tops]).view(*ids.shape, topk)
    i = torch.cat([t.indices for t in tops]).view(*ids.shape, topk)
    return (feats.clamp(-65000.0, 65000.0).half(), p.half(), i.int())


def trained_rows(response_mask: Sequence[bool]) -> np.ndarray:
    """(T,) bool: row t is trained when token t + 1 is a response token (never the last row)."""
    m = np.asarray(response_mask, dtype=bool)
    out = np.zeros(len(m), dtype=bool)
    out[:-1] = m[1:]
    return out


class SequenceFeatures:
    """What the recipes read of a training split: `len(fs)` sequences, `fs[s]` one of them as a
    dict of tensors (`FIELDS`, each (T_s, ...)) on `fs.device`, `fs.lengths` (n,) int64, and
    `fs.shards()`, flat groups of sequences for corpus-wide statistics. `FeatureSet` reads them
    from a built cache, `OnlineFeatures` computes them with the target when asked."""

    lengths: torch.Tensor
    device: torch.device

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, s: int) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def trained_any(self, s: int, first_row: int) -> bool:
        return bool(self[s]["trained"][first_row:].any())

    def sampler(self, min_length: int = 2, first_row: int = 0):
        """draw(gen) -> a random sequence (uniform over those longer than min_length tokens
        with a trained row at or after first_row).

        Raises:
            ValueError: no sequence qualifies.
        """
        usable = [s for s in range(len(self)) if self.lengths[s] > min_length
                  and self.trained_any(s, first_row)]
        if not usable:
            raise ValueError(f"no training sequence is longer than {min_length} tokens with a "
                             f"trained row from position {first_row} on")
        return lambda gen: self[usable[int(torch.randint(len(usable), (), generator=gen))]]

    @property
    def feature_width(self) -> int:
        return int(self[0]["feats"].shape[-1])

    def feature_rows(self, max_rows: int = 65536) -> torch.Tensor:
        """Up to `max_rows` feature rows (float32), position 0 of every sequence left out (the
        target's attention sink carries outsized activations there)."""
        rows, n = [], 0
        for s in range(len(self)):
            f = self[s]["feats"][1:]
            if f.shape[0] == 0:
                continue
            rows.append(f[:max_rows - n].float())
            n += rows[-1].shape[0]
            if n >= max_rows:
                break
        return torch.cat(rows)


class FeatureSet(SequenceFeatures):
    """A read-only view of a built cache (`SequenceFeatures`): memory-mapped shards, `shards()`
    the flat per-shard tensors."""

    def __init__(self, shards: List[Dict[str, np.ndarray]], limit: Optional[int] = None):
        if not shards:
            raise FileNotFoundError("the feature cache holds no shards")
        if limit is not None:               # the first `limit` sequences only (views, no copy)
            kept, left = [], limit
            for sh in shards:
                if left <= 0:
                    break
                m = min(left, len(sh["offsets"]) - 1)
                end = int(sh["offsets"][m])
                kept.append({**{f: sh[f][:end] for f in FIELDS}, "offsets": sh["offsets"][:m + 1]})
                left -= m
            if left > 0:
                raise ValueError(f"the feature cache holds {limit - left} sequences, "
                                 f"{limit} wanted")
            shards = kept
        self._shards = shards
        self._where: List[Tuple[int, int]] = []
        for k, sh in enumerate(shards):
            self._where += [(k, j) for j in range(len(sh["offsets"]) - 1)]
        self.lengths = torch.tensor([int(sh["offsets"][j + 1] - sh["offsets"][j])
                                     for k, sh in enumerate(shards)
                                     for j in range(len(sh["offsets"]) - 1)], dtype=torch.long)
        self.device = torch.device("cpu")

    def to(self, device) -> "FeatureSet":
        """Hand out every sequence's tensors on `device` from now on (the data stays on disk)."""
        self.device = torch.device(device)
        return self

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, s: int) -> Dict[str, torch.Tensor]:
        k, j = self._where[s]
        sh = self._shards[k]
        a, b = int(sh["offsets"][j]), int(sh["offsets"][j + 1])
        return {f: _tensor(sh[f][a:b]).to(self.device) for f in FIELDS}

    def trained_any(self, s: int, first_row: int) -> bool:
        k, j = self._where[s]
        sh = self._shards[k]
        a, b = int(sh["offsets"][j]), int(sh["offsets"][j + 1])
        return bool(sh["trained"][a + first_row:b].any())

    def shards(self) -> Iterator[Dict[str, torch.Tensor]]:
        for sh in self._shards:
            yield {f: _tensor(sh[f]) for f in FIELDS}


class OnlineFeatures(SequenceFeatures):
    """Features computed by the target when a sequence is asked for (`compute_features`, one
    forward per call, on the target's device): nothing is stored. For a GPU, where a target
    forward costs less than reading a cache of millions of rows from disk (a row is about 4.7 KB
    for four 576-wide layers). `shards()` covers the first `statistics_sequences` sequences only
    (the draft vocabulary is then ranked on that sample)."""

    def __init__(self, target, sequences: Sequence[Sequence[int]],
                 trained: Sequence[Sequence[bool]], layer_ids: List[int], topk: int,
                 statistics_sequences: int = 512, autocast: Optional[torch.dtype] = None):
        if not sequences:
            raise FileNotFoundError("no training sequences")
        for seq, m in zip(sequences, trained):
            if len(seq) != len(m):
                raise ValueError(f"trained: {len(m)} flags for a sequence of {len(seq)} tokens")
        self.target, self.layer_ids, self.topk = target, list(layer_ids), topk
        self._seqs = [list(x) for x in sequences]
        self._trained = [np.asarray(m, dtype=bool) for m in trained]
        self.lengths = torch.tensor([len(x) for x in self._seqs], dtype=torch.long)
        self.device = next(target.parameters()).device
        self.statistics_sequences = statistics_sequences
        self.autocast = autocast

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, s: int) -> Dict[str, torch.Tensor]:
        ids = torch.tensor([self._seqs[s]], dtype=torch.long, device=self.device)
        f, p, i = compute_features(self.target, ids, self.layer_ids, self.topk,
                                   autocast=self.autocast)
        return {"ids": ids[0].int(), "feats": f[0], "top_p": p[0], "top_i": i[0],
                "trained": torch.from_numpy(self._trained[s]).to(self.device)}

    def trained_any(self, s: int, first_row: int) -> bool:
        return bool(self._trained[s][first_row:].any())

    def shards(self) -> Iterator[Dict[str, torch.Tensor]]:
        for s in range(min(len(self), self.statistics_sequences)):
            yield {k: v.cpu() for k, v in self[s].items()}


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():           # memory-mapped arrays are read-only: never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class FeatureCache:
    """The cache folder of one list of sequences (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def complete(self, fingerprint: Optional[str] = None) -> bool:
        """meta.json exists (and, given a fingerprint, records that list of sequences)."""
        path = self.folder / "meta.json"
        if not path.exists():
            return False
        return fingerprint is None or json.loads(path.read_text()).get("fingerprint") == fingerprint

    def _path(self, k: int, field: str) -> Path:
        return self.folder / f"shard_{k:05d}.{field}.npy"

    def build(self, target, sequences: Sequence[Sequence[int]],
              trained: Sequence[Sequence[bool]], layer_ids: List[int], topk: int, meta: dict,
              desc: str = "caching target features", progress: bool = True,
              autocast: Optional[torch.dtype] = None) -> None:
        """Compute the missing shards (resumable), then write meta.json. A stored shard whose
        sequences equal, or begin with, the wanted ones (ids and trained flags) is kept.

        Args:
            sequences: token ids of each sequence (one target forward each).
            trained: per sequence, (T,) bools: which rows are training targets
                (`trained_rows` of a response mask; all but the last for raw text).
            autocast: `compute_features`'s (meta should record it: it changes the features).

        Raises:
            ValueError: a `trained` entry whose length differs from its sequence's.
        """
        for s, m in zip(sequences, trained):
            if len(s) != len(m):
                raise ValueError(f"trained: {len(m)} flags for a sequence of {len(s)} tokens")
        self.folder.mkdir(parents=True, exist_ok=True)
        n_shards = math.ceil(len(sequences) / SHARD_SEQUENCES)
        with tqdm(total=sum(map(len, sequences)), desc=desc, unit="tok", file=sys.stderr,
                  disable=not progress, dynamic_ncols=True) as bar:
            for k in range(n_shards):
                part = range(k * SHARD_SEQUENCES, min(len(sequences), (k + 1) * SHARD_SEQUENCES))
                want = ([sequences[s] for s in part], [trained[s] for s in part])
                if not self._holds(k, *want):
                    self._write_shard(k, target, *want, layer_ids, topk, autocast)
                bar.update(sum(len(sequences[s]) for s in part))
        tmp = self.folder / "meta.json.partial"
        tmp.write_text(json.dumps({**meta, "sequences": len(sequences),
                                   "rows": int(sum(map(len, sequences)))}, indent=2))
        os.replace(tmp, self.folder / "meta.json")

    def _holds(self, k: int, sequences, trained) -> bool:
        """Shard k is written and its first sequences are exactly `sequences` / `trained`."""
        if not self._path(k, "offsets").exists():
            return False
        offsets = np.load(self._path(k, "offsets"))
        if len(offsets) - 1 < len(sequences):
            return False
        ids = np.load(self._path(k, "ids"), mmap_mode="r")
        flags = np.load(self._path(k, "trained"), mmap_mode="r")
        for j, (seq, tr) in enumerate(zip(sequences, trained)):
            a, b = int(offsets[j]), int(offsets[j + 1])
            if (b - a != len(seq) or not np.array_equal(ids[a:b], np.asarray(seq, np.int32))
                    or not np.array_equal(flags[a:b], np.asarray(tr, bool))):
                return False
        return True

    def _write_shard(self, k, target, sequences, trained, layer_ids, topk, autocast) -> None:
        parts: Dict[str, list] = {f: [] for f in FIELDS}
        for seq, tr in zip(sequences, trained):        # one sequence per forward: bounded memory
            ids = torch.tensor([list(seq)], dtype=torch.long, device=_device(target))
            f, p, i = compute_features(target, ids, layer_ids, topk, autocast=autocast)
            parts["ids"].append(np.asarray(seq, dtype=np.int32))
            parts["feats"].append(f[0].cpu().numpy())
            parts["top_p"].append(p[0].cpu().numpy())
            parts["top_i"].append(i[0].cpu().numpy())
            parts["trained"].append(np.asarray(tr, dtype=bool))
        lengths = [len(s) for s in sequences]
        arrays = {f: np.concatenate(v) for f, v in parts.items()}
        arrays["offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for field in (*FIELDS, "offsets"):             # offsets last: it marks the shard written
            tmp = self._path(k, field).with_suffix(".partial.npy")
            np.save(tmp, arrays[field])
            os.replace(tmp, self._path(k, field))

    def load(self, sequences: Optional[int] = None) -> FeatureSet:
        """The cache's shards, memory-mapped: all of them, or the first `sequences` sequences.

        Raises:
            FileNotFoundError: no shard. ValueError: fewer than `sequences` sequences stored.
        """
        shards, k = [], 0
        while self._path(k, "offsets").exists() and (
                sequences is None or k * SHARD_SEQUENCES < sequences):
            shards.append({f: np.load(self._path(k, f), mmap_mode="r")
                           for f in (*FIELDS, "offsets")})
            k += 1
        if not shards:
            raise FileNotFoundError(f"feature cache {self.folder} holds no shards")
        return FeatureSet(shards, sequences)


# ----- training sequences ------------------------------------------------------------------------
def text_sequences(tokenizer, split: str, tokens: int, seq_len: int, seed: int = 0):
    """Packed raw text (`sharpdraft.data.pack_sequences`): (sequences, trained flags, meta)."""
    encode = data.tokenizer_encoder(tokenizer)
    seqs, counts = data.pack_sequences(encode, tokenizer.eos_token_id, split, tokens, seq_len,
                                       seed=seed)
    trained = [trained_rows([True] * len(s)).tolist() for s in seqs]
    return seqs, trained, {"source": "text", "tokens_per_source": counts, "seq_len": seq_len}


def corpus_sequences(folder, split: str, tokens: int, max_len: int):
    """Conversations of a self-distilled corpus (`sharpdraft.data.corpus`), in corpus order, until
    `tokens` response tokens: (sequences, trained flags, meta). A conversation longer than
    `max_len` keeps its last `max_len` tokens (the response is at the end).

    Raises:
        FileNotFoundError: `folder` holds no corpus, or none of the split.
    """
    from ..data import shards

    c = shards.load(folder, split)
    if len(c) == 0:
        raise FileNotFoundError(f"{folder}: the corpus has no {split} sequences")
    seqs, trained, by_kind, n = [], [], {}, 0
    for s, m, rec in zip(c.sequences, c.masks, c.records):
        if n >= tokens:
            break
        s, m = s[-max_len:], m[-max_len:]
        seqs.append(s.tolist())
        trained.append(trained_rows(m).tolist())
        kind = f"{rec.get('source')}/{rec.get('kind')}"
        by_kind[kind] = by_kind.get(kind, 0) + int(m.sum())
        n += int(m.sum())
    manifest = shards.read_manifest(Path(folder)) or {}
    return seqs, trained, {"source": "corpus", "corpus": str(folder), "max_len": max_len,
                           "response_tokens": n, "response_tokens_per_kind": by_kind,
                           "corpus_target_sha256": manifest.get("target", {}).get("sha256")}


def cache_key(meta: dict) -> str:
    """The cache folder's name: a digest of what fixes each sequence's features (target, layers,
    top-k, split, source and its length cut), not of the list of sequences (`LIST_FIELDS`), so a
    longer or shorter selection of the same corpus shares the folder and its shards."""
    kept = {k: v for k, v in meta.items() if k not in LIST_FIELDS}
    if isinstance(kept.get("target"), dict):   # --dtype auto's timing is no feature determinant
        kept["target"] = {k: v for k, v in kept["target"].items() if k != "dtype_rule_ms"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def _selection(tokenizer, provenance, layer_ids, split, tokens, seq_len, topk, seed,
               corpus) -> tuple:
    """(sequences, trained flags, cache meta) of one split's selection (`cached_features`)."""
    if corpus:
        seqs, trained, meta = corpus_sequences(corpus, split, tokens, seq_len)
    else:
        seqs, trained, meta = text_sequences(tokenizer, split, tokens, seq_len, seed)
    meta = {"format": "sharpdraft-features/2", "target": provenance, "layer_ids": layer_ids,
            "topk": topk, "split": split, **meta}
    meta["fingerprint"] = data.sequences_fingerprint(seqs)
    return seqs, trained, meta


def _with_autocast(meta: dict, autocast) -> dict:
    """`meta` keyed for features computed under `autocast` (None: the target's own precision,
    recorded as no field, so older keys hold)."""
    if autocast is None:
        return meta
    return {**meta, "autocast": str(autocast).replace("torch.", "")}


def _cache_folder(meta: dict, home: Optional[Path]) -> Path:
    from ..settings import sharpdraft_home

    return (home or sharpdraft_home()) / "train_cache" / cache_key(meta)


def complete_cache_dtype(tokenizer, provenance: dict, layer_ids: List[int], *, split: str,
                         tokens: int, seq_len: int, topk: int, seed: int = 0,
                         corpus: Optional[str] = None, home: Optional[Path] = None
                         ) -> Optional[str]:
    """The --cache-dtype ("bfloat16", else "float32") whose feature cache of this selection
    (`cached_features`' arguments) is already complete, or None: what lets `--cache-dtype auto`
    reuse the cache an earlier run built instead of timing both precisions again (a timing on
    a busy machine may choose the other one and rebuild everything)."""
    _, _, meta = _selection(tokenizer, provenance, layer_ids, split, tokens, seq_len, topk,
                            seed, corpus)
    for name, autocast in (("bfloat16", torch.bfloat16), ("float32", None)):
        if FeatureCache(_cache_folder(_with_autocast(meta, autocast), home)).complete(
                meta["fingerprint"]):
            return name
    return None


def cached_features(target, tokenizer, provenance: dict, layer_ids: List[int], *, split: str,
                    tokens: int, seq_len: int, topk: int, seed: int = 0,
                    corpus: Optional[str] = None, home: Optional[Path] = None,
                    online: bool = False, autocast: Optional[torch.dtype] = None) -> dict:
    """Build (once) or reuse the feature cache of one split; returns {"features": FeatureSet
    (on the target's device), "meta", "folder"}. The cache folder is keyed by what determines
    each sequence's features (`cache_key`), under $SHARPDRAFT_HOME/train_cache. online=True
    stores nothing: "features" is an `OnlineFeatures` and "folder" None. autocast: the target
    forwards run under `torch.autocast` in this dtype (`compute_features`), recorded in the
    meta as "autocast" and so keyed apart from the target's own precision."""
    seqs, trained, meta = _selection(tokenizer, provenance, layer_ids, split, tokens, seq_len,
                                     topk, seed, corpus)
    meta = _with_autocast(meta, autocast)
    if online:
        print(f"sharpdraft train: {split}: {len(seqs)} sequences, {sum(map(len, seqs))} tokens "
              f"({meta['source']}; features computed online)", file=sys.stderr)
        return {"features": OnlineFeatures(target, seqs, trained, layer_ids, topk,
                                           autocast=autocast),
                "meta": {**meta, "online": True}, "folder": None}
    cache = FeatureCache(_cache_folder(meta, home))
    if not cache.complete(meta["fingerprint"]):
        cache.build(target, seqs, trained, layer_ids, topk, meta,
                    desc=f"caching {split} features", autocast=autocast)
    print(f"sharpdraft train: {split}: {len(seqs)} sequences, {sum(map(len, seqs))} tokens "
          f"({meta['source']}; cache {cache.folder})", file=sys.stderr)
    return {"features": cache.load(len(seqs)).to(_device(target)), "meta": meta,
            "folder": str(cache.folder)}
