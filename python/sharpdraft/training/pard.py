"""`sharpdraft train pard`: train a PARD drafter from its target, on CPU.

Recipe:

1. Data and cache: the same cached target forwards as `sharpdraft train dflash`; PARD reads
   only the token ids and the target's top-k next-token distributions.
2. Model: the target's first ``--layers`` layers, final norm and mean embedding (as the mask
   embedding), with a reduced draft vocabulary (``--draft-vocab`` most frequent target ids).
3. Objective (multi-copy parallel drafting, `drafters.pard`): per step a random window of up to
   ``--window`` tokens reaching the sequence's trained rows; copy 0 predicts the next token,
   copy j (1 <= j < k) is all mask tokens and predicts j + 1 ahead of the real prefix it sees.
   Conditional token drop keeps copy j's row with probability ``--keep-rate`` given its
   ancestor row, so copy j holds about keep_rate^j of the rows. Soft cross-entropy against the
   target's renormalised top-k distribution on trained rows, averaged per copy, copies weighted
   equally. Mask-copy rows that neither have a trained target nor lead to one are dropped and
   the LM head runs on trained rows only (`trained_keep`; the same loss).
4. Every ``--eval-every`` steps: held-out top-1 agreement with the target per draft position and
   the acceptance proxy tau ~ 1 + E[leading agreeing drafts] on the last ``window`` tokens of
   every held-out sequence; the best checkpoint is kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..drafters.dflash import evenly_spaced_layers
from ..drafters.pard import PARDConfig, PARDDrafter, conditional_keep
from .eagle3 import window_start
from .losses import (copy_losses, decoding_walk, draft_vocabulary, soft_cross_entropy,
                     target_to_draft, trained_ahead)
from .loop import (add_common_arguments, autocast_dtype, check_window, finish, fit,
                   init_from_checkpoint, prepare_run, run_meta)


def _window(seq: dict, off: int, W: int, t2d):
    sl = slice(off, off + W)
    top_i = seq["top_i"][sl].long()
    return (seq["ids"][sl].long(), seq["top_p"][sl], top_i if t2d is None else t2d[top_i],
            top_i[..., 0], seq["trained"][sl])


def copy_rows(keep: torch.Tensor):
    """(position, copy) of every kept row of keep (C, T), copy-major as `train_logits` orders
    them."""
    C, T = keep.shape
    return (torch.arange(T)[None].expand(C, T)[keep], torch.arange(C)[:, None].expand(C, T)[keep])


def trained_keep(keep: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """keep (C, T) without the mask-copy rows that neither have a trained target nor lead to one:
    copy j >= 1 keeps row p only if a target among p .. p + C - 1 - j is trained (row p's own
    and its descendants' (j + i, p + i)). The dropped rows are no ancestors of a kept row and
    no keys of other anchors, so the loss on trained rows is unchanged; copy 0 stays whole
    (every real token is a key)."""
    C = keep.shape[0]
    out = keep.to(trained.device).clone()
    for j in range(1, C):                # a trained target at p .. p + C - 1 - j
        out[j] &= trained_ahead(trained, C - j)
    return out


def trained_rows_forward(drafter: PARDDrafter, target, ids, keep, trained, top_p, top_d):
    """The trimmed forward of training and evaluation: `keep` (C, T) less the rows that lead to
    no trained target (`trained_keep`), the LM head on trained rows only. Returns (logits of
    the trained rows, their positions in `copy_rows` order, the (C, T) mask of those rows, the
    per-copy mean soft cross-entropy (C,), NaN for a copy without one)."""
    keep = trained_keep(keep, trained)
    wanted = keep & trained[None, :]
    pos, copy = copy_rows(wanted)
    logits = drafter.train_logits(target, ids, keep, wanted)
    per_copy = copy_losses(soft_cross_entropy(logits, top_p[pos], top_d[pos]), copy,
                           keep.shape[0])
    return logits, pos, wanted, per_copy


@torch.no_grad()
def evaluate(drafter: PARDDrafter, target, features, window: int = 256) -> dict:
    """Held-out metrics over the last `window` tokens of every sequence with every copy row
    kept that leads to a trained target (`trained_keep`), trained rows only.

    Returns loss (copies weighted equally), top1_per_position (entry j: copy j's top-1 agreement
    with the target, i.e. draft j + 1's), and tau_proxy = 1 + mean over anchors P (copy 0's row
    P trained) of the number of leading drafts m = 1 .. k whose copy m - 1 row at P + m - 1
    agrees with the target's top-1 (an untrained row ends the run), and tau_walk, the tau of
    greedy decoding's own walk over those anchors (`losses.decoding_walk`).
    """
    k = drafter.config.num_draft_tokens
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    losses, hits, counts, lead, walks = [], torch.zeros(k), torch.zeros(k), [], []
    for s in range(len(features)):
        seq = features[s]
        W = min(window, seq["ids"].shape[0])
        if W <= k + 1 or not bool(seq["trained"][-W:].any()):
            continue
        ids, top_p, top_d, top1, trained = _window(seq, window_start(seq["trained"], W), W, t2d)
        keep = torch.ones(k, W, dtype=torch.bool)
        for j in range(k):
            keep[j, :j] = False
        keep[:, W - 1] = False
        # as in training (the same metrics, a fraction of the work on prompt rows)
        logits, pos, wanted, per_copy = trained_rows_forward(drafter, target, ids, keep,
                                                             trained, top_p, top_d)
        losses.append(float(per_copy[~per_copy.isnan()].mean()))
        guess = logits.argmax(-1) if drafter.d2t is None else drafter.d2t[logits.argmax(-1)]
        ok = torch.zeros(k, W, dtype=torch.bool)
        ok[wanted] = guess == top1[pos]
        hits += ok.sum(1)
        counts += wanted.sum(1)
        anchors = torch.arange(0, W - k)                              # P: draft m at P + m - 1
        rows = torch.stack([ok[m, anchors + m] for m in range(k)], dim=1)     # (A, k)
        runs = rows.int().cumprod(1).sum(1).float()
        lead.append(runs[trained[anchors]])
        walks.append(decoding_walk(runs, trained[anchors]))
    a = hits / counts.clamp_min(1.0)
    return {"loss": sum(losses) / len(losses),
            "top1_per_position": [round(float(x), 4) for x in a],
            "top1_mean": float(a.mean()), "tau_proxy": 1.0 + float(torch.cat(lead).mean()),
            "tau_walk": float(torch.cat(walks).mean())}


def make_loss(drafter: PARDDrafter, target, features, window: int, keep_rate: float):
    """loss_fn(gen, frac) for `loop.fit`: a random window of a random training sequence, all
    copies with conditional drop, per-copy mean soft cross-entropy on trained rows, copies
    weighted equally."""
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    k = drafter.config.num_draft_tokens
    draw = features.sampler(min_length=k + 1)

    def loss_fn(gen, frac):
        seq = draw(gen)
        W = min(window, seq["ids"].shape[0])
        ids, top_p, top_d, _, trained = _window(seq, window_start(seq["trained"], W, gen), W,
                                                t2d)
        _, _, wanted, per_copy = trained_rows_forward(
            drafter, target, ids, conditional_keep(k, W, keep_rate, gen), trained, top_p, top_d)
        return per_copy[~per_copy.isnan()].mean(), {"rows": int(wanted.sum())}
    return loss_fn


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, lr=5e-4, seq_len=1024)
    p.add_argument("--window", type=int, default=512,
                   help="training window in tokens (recorded as train_context)")
    p.add_argument("--layers", type=int, default=4, help="drafter layers (the target's first)")
    p.add_argument("--draft-tokens", type=int, default=8, help="k, drafts per forward")
    p.add_argument("--keep-rate", type=float, default=0.6,
                   help="conditional token drop: keep probability of a copy row given its ancestor")


def main(args: argparse.Namespace) -> dict:
    check_window(args, args.draft_tokens + 2, "--draft-tokens + 2")
    target, tokenizer, provenance, train, held, _ = prepare_run(
        args, lambda t: evenly_spaced_layers(t.config.num_hidden_layers, 4))
    if args.cache_only:
        return {"train_cache": train["folder"], "heldout_cache": held["folder"]}
    cfg = PARDConfig.from_target(target.config, num_layers=args.layers,
                                 num_draft_tokens=args.draft_tokens, train_context=args.window,
                                 draft_vocab_size=args.draft_vocab or None)
    tr = train["features"]
    init = None
    if args.init_from:
        drafter, init = init_from_checkpoint(PARDDrafter, args.init_from, target)
        init_layers = None
    else:
        drafter = PARDDrafter(cfg)
        vocab = target.get_output_embeddings().weight.shape[0]
        if cfg.draft_vocab_size is not None:
            drafter.set_draft_vocab(draft_vocabulary(tr, cfg.draft_vocab_size, vocab))
        init_layers = drafter.init_from_target(target)
    loss_fn = make_loss(drafter, target, tr, args.window, args.keep_rate)
    out = Path(args.out)
    meta = {**run_meta(args, provenance, drafter, init_layers, train, held), "init_from": init}
    print(f"sharpdraft train pard: {meta['drafter_params'] / 1e6:.2f}M parameters",
          file=sys.stderr)
    result = fit(drafter, target, loss_fn,
                 lambda: evaluate(drafter, target, held["features"], window=args.window),
                 steps=args.steps, lr=args.lr, warmup=args.warmup, eval_every=args.eval_every,
                 out=out, save_dtype=getattr(torch, args.save_dtype),
                 max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                 seed=args.seed, meta=meta, eval_at_start=init is not None,
                 desc="training pard", autocast=autocast_dtype(args.autocast))
    return finish(out, meta, result)
