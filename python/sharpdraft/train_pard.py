"""`sharpdraft train pard`: train a PARD drafter from the target on real text, on CPU.

Recipe:

1. Data and cache: the same packed sequences and cached target distributions (top-k
   probabilities per position) as `sharpdraft train dflash` (`train_dflash._cache_for`); PARD
   reads only the token ids and the target's distributions.
2. Model: the target's first ``--layers`` layers, final norm and mean embedding (as the mask
   embedding), with a reduced draft vocabulary (``--draft-vocab`` most frequent target ids).
3. Objective (multi-copy parallel drafting, ``drafters.pard``): per step a random window of
   ``--window`` tokens; copy 0 predicts the next token, copy j (1 <= j < k) is all mask tokens and
   predicts j + 1 ahead of the real prefix it sees. Conditional token drop keeps copy j's row with
   probability ``--keep-rate`` given its ancestor row, so copy j holds about keep_rate^j of the
   rows. Soft cross-entropy against the target's renormalised top-k distribution, averaged per
   copy, copies weighted equally. AdamW, warm-up then cosine decay over the steps or the time budget.
4. Every ``--eval-every`` steps: held-out top-1 agreement with the target per draft position and
   the acceptance proxy tau ~ 1 + E[leading agreeing drafts]; the best checkpoint is kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict

import torch

from .drafters.pard import PARDConfig, PARDDrafter, conditional_keep
from .train_common import add_common_arguments, finish, fit, load_data, run_meta
from .train_dflash import draft_vocabulary, soft_cross_entropy, target_to_draft


def copy_losses(ce: torch.Tensor, copy: torch.Tensor, num_copies: int) -> torch.Tensor:
    """(C,) mean of the per-row losses `ce` (R,) of each copy (`copy` (R,) int64); NaN where a
    copy has no rows."""
    total = torch.zeros(num_copies, dtype=ce.dtype).index_add(0, copy, ce)
    count = torch.zeros(num_copies, dtype=ce.dtype).index_add(0, copy, torch.ones_like(ce))
    return total / count


def _rows(cache: Dict[str, torch.Tensor], s: int, off: int, W: int, t2d):
    ids = cache["ids"][s, off:off + W].long()
    top_p = cache["top_p"][s, off:off + W]
    top_i = cache["top_i"][s, off:off + W].long()
    return ids, top_p, (top_i if t2d is None else t2d[top_i]), top_i[..., 0]


@torch.no_grad()
def evaluate(drafter: PARDDrafter, target, cache: Dict[str, torch.Tensor], window: int = 256,
             windows_per_seq: int = 2) -> dict:
    """Held-out metrics over fixed windows with every copy row kept.

    Returns loss (copies weighted equally), top1_per_position (entry j: copy j's top-1 agreement
    with the target, i.e. draft j + 1's), and tau_proxy = 1 + mean over anchors P of the number of
    leading drafts m = 1 .. k whose copy m - 1 row at P + m - 1 agrees with the target's top-1.
    """
    k = drafter.config.num_draft_tokens
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    losses, agree, lead = [], [], []
    for s in range(cache["ids"].shape[0]):
        T = cache["ids"].shape[1]
        for w in range(windows_per_seq):
            off = (T - window) * w // max(1, windows_per_seq - 1)
            ids, top_p, top_d, top1 = _rows(cache, s, off, window, t2d)
            keep = torch.ones(k, window, dtype=torch.bool)
            for j in range(k):
                keep[j, :j] = False
            keep[:, window - 1] = False
            logits = drafter.train_logits(target, ids, keep)
            pos = torch.arange(window)[None].expand(k, window)[keep]
            copy = torch.arange(k)[:, None].expand(k, window)[keep]
            ce = soft_cross_entropy(logits, top_p[pos], top_d[pos])
            losses.append(float(copy_losses(ce, copy, k).mean()))
            guess = logits.argmax(-1) if drafter.d2t is None else drafter.d2t[logits.argmax(-1)]
            ok = torch.zeros(k, window, dtype=torch.bool)
            ok[keep] = guess == top1[pos]
            agree.append(torch.stack([ok[j, keep[j]].float().mean() for j in range(k)]))
            anchors = torch.arange(0, window - k)                       # P: draft m at P + m - 1
            rows = torch.stack([ok[m, anchors + m] for m in range(k)], dim=1)   # (A, k)
            lead.append(rows.int().cumprod(1).sum(1).float())
    a = torch.stack(agree).mean(0)
    return {"loss": sum(losses) / len(losses),
            "top1_per_position": [round(float(x), 4) for x in a],
            "top1_mean": float(a.mean()), "tau_proxy": 1.0 + float(torch.cat(lead).mean())}


def make_loss(drafter: PARDDrafter, target, cache: Dict[str, torch.Tensor], window: int,
              keep_rate: float):
    """loss_fn(gen) for `train_common.fit`: a random window of a random cached sequence, all
    copies with conditional drop, per-copy mean soft cross-entropy, copies weighted equally."""
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    k, W = drafter.config.num_draft_tokens, window
    n_seq, T = cache["ids"].shape

    def loss_fn(gen):
        s = int(torch.randint(n_seq, (), generator=gen))
        off = int(torch.randint(T - W + 1, (), generator=gen))
        ids, top_p, top_d, _ = _rows(cache, s, off, W, t2d)
        keep = conditional_keep(k, W, keep_rate, gen)
        pos = torch.arange(W)[None].expand(k, W)[keep]
        copy = torch.arange(k)[:, None].expand(k, W)[keep]
        logits = drafter.train_logits(target, ids, keep)
        per_copy = copy_losses(soft_cross_entropy(logits, top_p[pos], top_d[pos]), copy, k)
        return per_copy[~per_copy.isnan()].mean(), {"rows": int(keep.sum())}
    return loss_fn


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, lr=5e-4, window=512)
    p.add_argument("--layers", type=int, default=4, help="drafter layers (the target's first)")
    p.add_argument("--draft-tokens", type=int, default=8, help="k, drafts per forward")
    p.add_argument("--keep-rate", type=float, default=0.6,
                   help="conditional token drop: keep probability of a copy row given its ancestor")


def main(args: argparse.Namespace) -> dict:
    from .models import load_target

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, tokenizer, provenance = load_target(args.target, dtype=torch.float32)
    _, train_c, eval_c = load_data(args, target, tokenizer, provenance)
    cfg = PARDConfig.from_target(target.config, num_layers=args.layers,
                                 num_draft_tokens=args.draft_tokens, train_context=args.window,
                                 draft_vocab_size=args.draft_vocab or None)
    drafter = PARDDrafter(cfg)
    tr = train_c["tensors"]
    vocab = target.get_output_embeddings().weight.shape[0]
    if cfg.draft_vocab_size is not None:
        drafter.set_draft_vocab(draft_vocabulary(tr, cfg.draft_vocab_size, vocab))
    init_layers = drafter.init_from_target(target)
    loss_fn = make_loss(drafter, target, tr, args.window, args.keep_rate)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(args, provenance, drafter, init_layers, train_c)
    print(f"sharpdraft train pard: {meta['drafter_params'] / 1e6:.2f}M parameters",
          file=sys.stderr)
    result = fit(drafter, target, loss_fn, lambda: evaluate(drafter, target, eval_c["tensors"]),
                 steps=args.steps, lr=args.lr, warmup=args.warmup, eval_every=args.eval_every,
                 out=out, save_dtype=getattr(torch, args.save_dtype),
                 max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                 seed=args.seed, meta=meta, desc="training pard")
    return finish(out, meta, result)
