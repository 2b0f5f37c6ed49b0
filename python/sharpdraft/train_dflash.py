"""`sharpdraft train dflash`: distil a DFlash drafter from a target on real text, on CPU.

Recipe:

1. Data (``sharpdraft.data``): packed sequences of ``--seq-len`` tokens (<= 1024 here) from the KJV,
   champ-dataset maths, HumanEval and the Python standard library, train and held-out splits.
2. Cache (once, under ``$SHARPDRAFT_HOME/train_cache/<key>/``): one target forward per sequence
   gives the drafter's context features (the selected layers' outputs, float16) and the target's
   next-token distribution at every position, kept as its top-k probabilities and ids.
3. Training: per step, ``--blocks`` random anchors per sequence; each block is the anchor token
   followed by b - 1 mask tokens and sees the context before its anchor plus its whole block (the
   block-attention training mask of ``DFlashDrafter.block_logits``). Row j of a block is trained
   against the target's distribution for position anchor + j (soft cross-entropy on the top-k,
   renormalised), weighted by exp(-(j - 1) / gamma). AdamW, linear warm-up then cosine decay.
4. Every ``--eval-every`` steps: held-out top-1 agreement with the target per block position and
   the acceptance proxy tau ~ 1 + E[number of leading agreeing positions]; the best checkpoint
   (drafter weights only, bfloat16 by default) is written to ``--out``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import data
from .drafters.dflash import DFlashConfig, DFlashDrafter, default_mask_token_id
from .models import sharpdraft_home
from .runtime import captured_hidden_states

CACHE_SHARD = 8  # sequences per cache file


# ----- feature cache --------------------------------------------------------------------------------
@torch.no_grad()
def compute_features(target, ids: torch.Tensor, layer_ids: List[int], topk: int,
                     rows_per_chunk: int = 1024):
    """One target forward over ids (n, L): (features float16 (n, L, F*H), top-k probs float16
    (n, L, k), top-k ids int32 (n, L, k)); position t's distribution predicts token t + 1.

    Only the layers read are kept (forward hooks, not output_hidden_states), and the LM head
    runs on `rows_per_chunk` rows at a time, so the full (n, L, vocab) logits never exist."""
    last = len(target.get_decoder().layers)
    with captured_hidden_states(target, [i + 1 for i in layer_ids] + [last]) as hidden:
        target.get_decoder()(input_ids=ids, use_cache=False)
    feats = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1).float()
    flat = hidden[last].reshape(-1, hidden[last].shape[-1])
    head = target.get_output_embeddings()
    tops = [torch.softmax(head(flat[r:r + rows_per_chunk]).float(), dim=-1).topk(topk, dim=-1)
            for r in range(0, flat.shape[0], rows_per_chunk)]
    p = torch.cat([t.values for t in tops]).view(*ids.shape, topk)
    i = torch.cat([t.indices for t in tops]).view(*ids.shape, topk)
    return (feats.clamp(-65000.0, 65000.0).half(), p.half(), i.int())


class FeatureCache:
    """Cached target features of a list of sequences: shards of CACHE_SHARD sequences in `folder`.

    Files: shard_XXXXX.safetensors with "ids" (n, L) int32, "feats" (n, L, F*H) float16, "top_p"
    (n, L, k) float16, "top_i" (n, L, k) int32; meta.json (written last, marks completion).
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def complete(self) -> bool:
        return (self.folder / "meta.json").exists()

    def build(self, target, seqs: List[List[int]], layer_ids: List[int], topk: int,
              meta: dict, desc: str = "caching target features") -> None:
        """Compute the missing shards (resumable), then write meta.json."""
        self.folder.mkdir(parents=True, exist_ok=True)
        n_shards = math.ceil(len(seqs) / CACHE_SHARD)
        with tqdm(total=len(seqs), desc=desc, unit="seq", file=sys.stderr) as bar:
            for s in range(n_shards):
                path = self.folder / f"shard_{s:05d}.safetensors"
                chunk = seqs[s * CACHE_SHARD:(s + 1) * CACHE_SHARD]
                if not path.exists():
                    parts = {"ids": [], "feats": [], "top_p": [], "top_i": []}
                    for seq in chunk:  # one sequence per forward: bounded memory
                        ids = torch.tensor([seq], dtype=torch.long)
                        f, p, i = compute_features(target, ids, layer_ids, topk)
                        for k, v in zip(parts, (ids.int(), f, p, i)):
                            parts[k].append(v)
                    tmp = path.with_suffix(".partial")
                    save_file({k: torch.cat(v).contiguous() for k, v in parts.items()}, str(tmp))
                    os.replace(tmp, path)
                bar.update(len(chunk))
        (self.folder / "meta.json").write_text(json.dumps({**meta, "sequences": len(seqs)},
                                                          indent=2))

    def load(self) -> Dict[str, torch.Tensor]:
        """All shards concatenated (in memory)."""
        shards = sorted(self.folder.glob("shard_*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"feature cache {self.folder} holds no shards")
        parts = [load_file(str(p)) for p in shards]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# ----- loss and evaluation ------------------------------------------------------------------------
def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(b - 1,) loss weights of block rows 1 .. b - 1: exp(-(j - 1) / gamma)."""
    j = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(j - 1) / gamma)


def sample_anchors(T: int, block_size: int, n: int, gen: torch.Generator,
                   max_anchor: Optional[int] = None) -> torch.Tensor:
    """n distinct anchors in [1, min(T - b, max_anchor)] (each block's targets lie inside the
    sequence), sorted."""
    hi = T - block_size  # inclusive
    if max_anchor is not None:
        hi = max(min(hi, max_anchor), 1)
    n = min(n, hi)
    return (torch.randperm(hi, generator=gen)[:n] + 1).sort().values


def block_batch(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int):
    """block_ids (K, b) and the target rows (K, b - 1) = positions anchor + j - 1 (j >= 1)."""
    block = torch.full((len(anchors), block_size), mask_id, dtype=torch.long)
    block[:, 0] = ids[anchors].long()
    rows = anchors[:, None] + torch.arange(0, block_size - 1)
    return block, rows


def draft_vocabulary(cache: Dict[str, torch.Tensor], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids the drafter may propose, sorted: the most frequent in the cached
    corpus, counting each position's token, the target's top-1 token there, and its top-k
    probability mass (which ranks tokens that are never a top-1)."""
    if not 2 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must lie in [2, {vocab_size}], got {size}")
    top_i = cache["top_i"].long()
    counts = (torch.bincount(cache["ids"].flatten().long(), minlength=vocab_size).double()
              + torch.bincount(top_i[..., 0].flatten(), minlength=vocab_size)
              + torch.bincount(top_i.flatten(), weights=cache["top_p"].flatten().double(),
                               minlength=vocab_size))
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def target_to_draft(d2t: Optional[torch.Tensor], vocab_size: int) -> Optional[torch.Tensor]:
    """(vocab_size,) map target id -> draft id, -1 outside the draft vocabulary (None: identity)."""
    if d2t is None:
        return None
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    return t2d


def soft_cross_entropy(logits: torch.Tensor, top_p: torch.Tensor,
                       top_i: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of drafter logits (..., V) against the target's top-k distribution
    (top_p, top_i (..., k); ids in the drafter's vocabulary, -1 = outside it, dropped before
    renormalising); returns (...)."""
    logq = torch.log_softmax(logits, dim=-1)
    top_i = top_i.long()
    p = top_p.float() * (top_i >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    return -(p * logq.gather(-1, top_i.clamp_min(0))).sum(-1)


def distill_loss(logits: torch.Tensor, top_p: torch.Tensor, top_i: torch.Tensor,
                 weights: torch.Tensor):
    """Weighted soft cross-entropy against the target's renormalised top-k distribution.

    Args:
        logits: (K, b - 1, V) drafter logits of rows 1 .. b - 1 over its draft vocabulary.
        top_p, top_i: (K, b - 1, k) the target's top-k probabilities and their ids in the draft
            vocabulary (-1: outside it; such entries are dropped before renormalising).
        weights: (b - 1,) per-row weights.

    Returns:
        (loss, per-row mean cross-entropy (b - 1,)).
    """
    ce = soft_cross_entropy(logits, top_p, top_i)                  # (K, b - 1)
    per_row = ce.mean(0)
    return (per_row * weights).sum() / weights.sum(), per_row.detach()


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target, cache: Dict[str, torch.Tensor], blocks: int,
             gamma: float, seed: int = 1234, scale: Optional[torch.Tensor] = None) -> dict:
    """Held-out metrics with fixed anchors: loss, top-1 agreement per block position, tau proxy."""
    b = drafter.config.block_size
    gen = torch.Generator().manual_seed(seed)
    w = position_weights(b, gamma)
    agree, lead, losses = [], [], []
    was_training = drafter.training
    drafter.eval()
    d2t = drafter.d2t
    t2d = target_to_draft(d2t, target.get_output_embeddings().weight.shape[0])
    for s in range(cache["ids"].shape[0]):
        ids = cache["ids"][s]
        anchors = sample_anchors(ids.shape[0], b, blocks, gen)
        block, rows = block_batch(ids, anchors, b, drafter.config.mask_token_id)
        feats = cache["feats"][s].float()
        if scale is not None:
            feats = feats * scale
        logits = drafter.block_logits(target, feats, block, anchors)[:, 1:]
        top_i = cache["top_i"][s][rows].long()
        loss, _ = distill_loss(logits, cache["top_p"][s][rows],
                               top_i if t2d is None else t2d[top_i], w)
        losses.append(float(loss))
        guess = logits.argmax(-1) if d2t is None else d2t[logits.argmax(-1)]
        ok = guess == top_i[..., 0]                                           # (K, b - 1)
        agree.append(ok.float())
        lead.append(ok.int().cumprod(-1).sum(-1).float())
    drafter.train(was_training)
    agree_t = torch.cat(agree)
    return {"loss": sum(losses) / len(losses),
            "top1_per_position": [round(float(x), 4) for x in agree_t.mean(0)],
            "top1_mean": float(agree_t.mean()),
            "tau_proxy": 1.0 + float(torch.cat(lead).mean())}


# ----- training -----------------------------------------------------------------------------------
def lr_at(step: int, steps: int, lr: float, warmup: int, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 0 over the steps or the time budget, whichever
    runs out first (time_frac = elapsed / max_seconds)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = max((step - warmup) / max(1, steps - warmup), time_frac)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def init_from_target(drafter: DFlashDrafter, target, where: str = "early") -> List[int]:
    """Start the drafter from target weights; returns the target layers copied.

    "early": drafter layer i = target layer i, and the context projection starts as the identity
    on the first feature (the output of target layer target_layer_ids[0], a shallow state close
    to what target layer 0 reads), normalised with target layer 0's input norm. The drafter then
    starts as the target's first layers run over [context ; block] (early-exit logits through
    the target's final norm and head): its attention already has local and previous-token heads,
    which a random drafter must discover through attention diluted over the whole context.
    "late": drafter layers = the target's last layers (context projection random).
    """
    layers = target.model.layers
    n = len(drafter.layers)
    chosen = list(range(n)) if where == "early" else list(range(len(layers) - n, len(layers)))
    for mine, idx in zip(drafter.layers, chosen):
        mine.load_state_dict(layers[idx].state_dict())
    drafter.norm.load_state_dict(target.model.norm.state_dict())
    if where == "early":
        h = drafter.config.target_hidden_size
        with torch.no_grad():
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, :h].copy_(torch.eye(h, drafter.config.hidden_size).T)
            drafter.hidden_norm.weight.copy_(layers[0].input_layernorm.weight)
    return chosen


def feature_scale(feats: torch.Tensor, max_rows: int = 65536) -> torch.Tensor:
    """(F*H,) per-dimension 1 / RMS of the context features, over positions >= 1.

    A few target dimensions carry massive activations (SmolLM2: dim 507 of layer 19 is ~10^2
    everywhere and ~2*10^4 at position 0, against a median of ~4); through a random projection
    and RMSNorm they make every context vector nearly the same and the drafter collapses to a
    unigram guess. Training feeds features * scale to `fc`; `save_checkpoint` folds the scale
    into fc's weight, so the saved drafter reads raw features (inference is unchanged).
    """
    x = feats[:, 1:].reshape(-1, feats.shape[-1])[:max_rows].float()
    return x.pow(2).mean(0).sqrt().clamp_min(1e-3).reciprocal()


def folded_drafter(drafter: DFlashDrafter, scale: Optional[torch.Tensor]) -> DFlashDrafter:
    """A copy of `drafter` whose fc reads raw features (feature scale folded into its weight)."""
    snapshot = DFlashDrafter(drafter.config)
    snapshot.load_state_dict(drafter.state_dict())
    if scale is not None:
        with torch.no_grad():
            snapshot.fc.weight.mul_(scale[None, :].to(snapshot.fc.weight.dtype))
    return snapshot.eval()


def save_checkpoint(drafter: DFlashDrafter, folder: Path, dtype: torch.dtype, extra: dict,
                    scale: Optional[torch.Tensor] = None) -> None:
    folder = Path(folder)
    folded_drafter(drafter, scale).to(dtype).save(folder)
    (folder / "training.json").write_text(json.dumps(extra, indent=2) + "\n")


def train(drafter: DFlashDrafter, target, train_cache: Dict[str, torch.Tensor],
          eval_cache: Optional[Dict[str, torch.Tensor]], *, steps: int, blocks: int = 16,
          lr: float = 6e-4, warmup: int = 50, gamma: float = 7.0, weight_decay: float = 0.01,
          grad_clip: float = 1.0, eval_every: int = 100, eval_blocks: int = 32, seed: int = 0,
          out: Optional[Path] = None, save_dtype: torch.dtype = torch.bfloat16,
          max_seconds: Optional[float] = None, log_file: Optional[Path] = None,
          meta: Optional[dict] = None, progress: bool = True, anchor_warmup: float = 0.0,
          min_context: int = 32, scale_features: bool = True) -> dict:
    """Train `drafter` in place; returns {"history": [...], "evals": [...], "best": {...}}.

    anchor_warmup: fraction of the run over which the largest anchor position grows linearly
    from min_context to the sequence length (0: full-length anchors from the start). Short
    contexts first let the block rows find the anchor and the nearby context before their
    attention is spread over a thousand keys.
    """
    for p in target.parameters():
        p.requires_grad_(False)
    b = drafter.config.block_size
    mask_id = drafter.config.mask_token_id
    w = position_weights(b, gamma)
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    n_seq = train_cache["ids"].shape[0]
    scale = feature_scale(train_cache["feats"]) if scale_features else None
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    history, evals, best = [], [], None
    t0 = time.time()
    logf = open(log_file, "a") if log_file else None

    def log(rec):
        if logf:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()

    def do_eval(step):
        nonlocal best
        if eval_cache is None:
            return
        ev = {"step": step, "elapsed_s": round(time.time() - t0, 1),
              **evaluate(drafter, target, eval_cache, eval_blocks, gamma, scale=scale)}
        evals.append(ev)
        log({"eval": ev})
        tqdm.write(f"eval step {step}: loss {ev['loss']:.3f} tau~{ev['tau_proxy']:.3f} top1 "
                   f"{' '.join(f'{x:.2f}' for x in ev['top1_per_position'])}", file=sys.stderr)
        if best is None or ev["tau_proxy"] > best["tau_proxy"]:
            best = ev
            if out is not None:
                save_checkpoint(drafter, out, save_dtype, {**(meta or {}), "best_eval": ev,
                                                            "evals": evals}, scale)

    drafter.train()
    order = torch.randperm(n_seq, generator=gen)
    bar = tqdm(range(steps), desc="training", unit="step", file=sys.stderr, disable=not progress)
    step = 0
    for step in bar:
        if step and step % eval_every == 0:
            do_eval(step)
        s = int(order[step % n_seq])
        if step % n_seq == n_seq - 1:
            order = torch.randperm(n_seq, generator=gen)
        ids = train_cache["ids"][s]
        T = ids.shape[0]
        max_anchor = None
        if anchor_warmup > 0:  # context curriculum: short contexts first, the full length later
            frac = max(step / steps, (time.time() - t0) / max_seconds if max_seconds else 0.0)
            max_anchor = int(min_context + (T - min_context) * min(1.0, frac / anchor_warmup))
        anchors = sample_anchors(T, b, blocks, gen, max_anchor)
        block, rows = block_batch(ids, anchors, b, mask_id)
        time_frac = (time.time() - t0) / max_seconds if max_seconds else 0.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup, time_frac)
        feats = train_cache["feats"][s].float()
        if scale is not None:
            feats = feats * scale
        logits = drafter.block_logits(target, feats, block, anchors)
        top_i = train_cache["top_i"][s][rows].long()
        loss, per_row = distill_loss(logits[:, 1:], train_cache["top_p"][s][rows],
                                     top_i if t2d is None else t2d[top_i], w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        rec = {"step": step, "loss": round(float(loss.detach()), 4),
               "grad_norm": round(float(gnorm), 3),
               "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.time() - t0, 1)}
        history.append(rec)
        if step % 10 == 0:
            log(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")
        if max_seconds is not None and time.time() - t0 > max_seconds:
            tqdm.write(f"time budget reached after {step + 1} steps", file=sys.stderr)
            break
    bar.close()
    do_eval(step + 1)
    if logf:
        logf.close()
    return {"history": history, "evals": evals, "best": best, "steps_done": step + 1,
            "seconds": time.time() - t0, "feature_scale": scale}


# ----- command line ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=131072, help="training tokens to cache")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens to cache")
    p.add_argument("--seq-len", type=int, default=1024,
                   help="training context length (recorded as train_context)")
    p.add_argument("--steps", type=int, default=2000,
                   help="optimiser steps (the schedule's length)")
    p.add_argument("--blocks", type=int, default=16, help="draft blocks per sequence and step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--features", type=int, default=4, help="target layers read as context")
    p.add_argument("--topk", type=int, default=32, help="cached target probabilities per position")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft vocabulary size: the most frequent target tokens of the training "
                        "corpus (0: the whole target vocabulary)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=60, help="linear warm-up steps")
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay along the block")
    p.add_argument("--eval-every", type=int, default=200,
                   help="held-out evaluation (and best-checkpoint) period in steps")
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--init", choices=["early", "late", "random"], default="early",
                   help="start the drafter from the target's first layers (early), its last "
                        "layers (late), or randomly (see init_from_target)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the saved weights")
    p.add_argument("--anchor-warmup", type=float, default=0.3,
                   help="fraction of the run over which anchors grow from --min-context to "
                        "the sequence length (context curriculum; 0 = off)")
    p.add_argument("--min-context", type=int, default=32)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="time budget of the training loop: the cosine schedule ends at the "
                        "steps or this budget, whichever comes first (best checkpoint kept)")
    p.add_argument("--cache-only", action="store_true",
                   help="build the feature caches and stop (a later run with the same data "
                        "options reuses them)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation seed")


def _cache_for(target, tokenizer, provenance, layer_ids, args, split, tokens) -> Dict:
    encode = data.tokenizer_encoder(tokenizer)
    seqs, counts = data.pack_sequences(encode, tokenizer.eos_token_id, split, tokens,
                                       args.seq_len, seed=args.seed)
    meta = {"target": provenance, "layer_ids": layer_ids, "topk": args.topk,
            "seq_len": args.seq_len, "split": split, "tokens_per_source": counts,
            "fingerprint": data.sequences_fingerprint(seqs)}
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    cache = FeatureCache(sharpdraft_home() / "train_cache" / key)
    if not cache.complete():
        cache.build(target, seqs, layer_ids, args.topk, meta, desc=f"caching {split} features")
    print(f"sharpdraft train: {split}: {len(seqs)} sequences x {args.seq_len} tokens {counts} "
          f"(cache {cache.folder})", file=sys.stderr)
    return {"tensors": cache.load(), "meta": meta, "folder": str(cache.folder)}


def main(args: argparse.Namespace) -> dict:
    from .models import load_target

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, tokenizer, provenance = load_target(args.target, dtype=torch.float32)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=default_mask_token_id(tokenizer),
                                   num_layers=args.layers, block_size=args.block_size,
                                   num_features=args.features, train_context=args.seq_len,
                                   draft_vocab_size=args.draft_vocab or None)
    t0 = time.time()
    train_c = _cache_for(target, tokenizer, provenance, cfg.target_layer_ids, args, "train",
                         args.tokens)
    eval_c = _cache_for(target, tokenizer, provenance, cfg.target_layer_ids, args, "heldout",
                        args.eval_tokens)
    cache_s = time.time() - t0
    if args.cache_only:
        return {"train_cache": train_c["folder"], "heldout_cache": eval_c["folder"]}
    drafter = DFlashDrafter(cfg)
    if cfg.draft_vocab_size is not None:
        vocab = target.get_output_embeddings().weight.shape[0]
        drafter.set_draft_vocab(draft_vocabulary(train_c["tensors"], cfg.draft_vocab_size, vocab))
    init_layers = init_from_target(drafter, target, args.init) if args.init != "random" else None
    n_params = sum(p.numel() for p in drafter.parameters())
    out = Path(args.out)
    meta = {"command": "sharpdraft " + " ".join(sys.argv[1:]) if sys.argv else None,
            "args": vars(args), "target": provenance, "drafter_params": n_params,
            "init_from_target_layers": init_layers,
            "train_tokens_per_source": train_c["meta"]["tokens_per_source"],
            "heldout_tokens_per_source": eval_c["meta"]["tokens_per_source"],
            "cache_seconds": round(cache_s, 1)}
    print(f"sharpdraft train: drafter {n_params / 1e6:.2f}M parameters, {args.steps} steps",
          file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    result = train(drafter, target, train_c["tensors"], eval_c["tensors"], steps=args.steps,
                   blocks=args.blocks, lr=args.lr, warmup=args.warmup, gamma=args.gamma,
                   eval_every=args.eval_every, eval_blocks=args.eval_blocks, seed=args.seed,
                   out=out, save_dtype=getattr(torch, args.save_dtype),
                   max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                   log_file=out / "train_log.jsonl", meta=meta,
                   anchor_warmup=args.anchor_warmup, min_context=args.min_context)
    summary = {**meta, "steps_done": result["steps_done"],
               "train_seconds": round(result["seconds"], 1), "best_eval": result["best"],
               "final_train_loss_avg50": sum(h["loss"] for h in result["history"][-50:])
               / max(1, len(result["history"][-50:])), "evals": result["evals"]}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("steps_done", "train_seconds", "best_eval",
                                              "final_train_loss_avg50")}, indent=2))
    return summary
