"""The corpus's on-disk format (`FORMAT`): shards of token sequences and the manifest that lists
them, each written atomically; `load` reads a split back.

    DIR/manifest.json              what was generated, how, and from what (rewritten atomically)
    DIR/train/shard_00000.npz      the train split's sequences
    DIR/heldout/shard_00000.npz    the held-out split's (documents never in train)

A shard holds whole sequences (prompt + response) as flat arrays (`np.savez_compressed`):
``tokens`` (uint16 when the vocabulary fits, else int32), ``response_mask`` (uint8, 1 on the
tokens the target generated), ``offsets`` (int64, sequence i is ``tokens[offsets[i]:offsets[i+1]]``)
and ``prompt_index`` (int32, the prompt's position in its split's prompt order). Each file is
written under a temporary name (``.<name>.tmp-<pid>``) and renamed, the shard first, then the
manifest: a crash leaves at most a stray temporary file and an unlisted shard, both ignored
(`remove_temporaries` clears the former; the latter is overwritten when its shard is redone).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import sources as data

FORMAT = "sharpdraft-corpus/1"
MANIFEST = "manifest.json"


def _atomic_write(path: Path, write: Callable) -> None:
    """write(file) into `.<name>.tmp-<pid>` beside `path`, fsync, then rename onto `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_temporaries(out: Path) -> None:
    """Delete the temporary files an interrupted write left in corpus folder `out`."""
    for tmp in list(out.glob(".*.tmp-*")) + list(out.glob("*/.*.tmp-*")):
        tmp.unlink(missing_ok=True)


def write_shard(path: Path, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[int]],
                prompt_index: Sequence[int], vocab_size: int) -> None:
    """One shard (see the module docstring), written atomically.

    Args:
        sequences: token ids (prompt + response) of each sequence.
        masks: per sequence, 1 on the response tokens, 0 on the prompt's (same lengths).
        prompt_index: per sequence, its prompt's position in the split's prompt order.
        vocab_size: the tokenizer's; tokens are stored as uint16 when it is <= 65536.

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
    """(sequences: int64 arrays, masks: bool arrays, True on response tokens) of one shard."""
    with np.load(path) as z:
        tokens, mask, off = z["tokens"].astype(np.int64), z["response_mask"], z["offsets"]
    return ([tokens[a:b] for a, b in zip(off[:-1], off[1:])],
            [mask[a:b].astype(bool) for a, b in zip(off[:-1], off[1:])])


def read_manifest(out: Path) -> Optional[dict]:
    """The manifest of corpus folder `out`, or None when it has none."""
    path = Path(out) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def write_manifest(out: Path, manifest: dict) -> None:
    """Replace the manifest of corpus folder `out` (atomically)."""
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
