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

import torch

from ..drafters.pard import PARDConfig, PARDDrafter, conditional_keep
from .common import draft_guess, last_windows, window_start
from .losses import copy_losses, decoding_walk, soft_cross_entropy, target_to_draft, trained_ahead
from .loop import Plan, Recipe, add_common_arguments, check_window, with_draft_vocab


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
    for seq, W, off in last_windows(features, window, k + 1):
        ids, top_p, top_d, top1, trained = _window(seq, off, W, t2d)
        keep = torch.ones(k, W, dtype=torch.bool)
        for j in range(k):
            keep[j, :j] = False
        keep[:, W - 1] = False
        # as in training (the same metrics, a fraction of the work on prompt rows)
        logits, pos, wanted, per_copy = trained_rows_forward(drafter, target, ids, keep,
                                                             trained, top_p, top_d)
        losses.append(float(per_copy[~per_copy.isnan()].mean()))
        ok = torch.zeros(k, W, dtype=torch.bool)
        ok[wanted] = draft_guess(drafter, logits) == top1[pos]
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


def anchor_leads(drafter: PARDDrafter, target, seq: dict, anchors: torch.Tensor
                 ) -> torch.Tensor:
    """(A,) int64: at each anchor, how many of the k parallel drafts (copy m at anchor + m
    drafts m + 1), in order, equal the target's top-1 along the text (teacher forced, one
    forward over the kept copy rows; `seq` a cached sequence)."""
    k = drafter.config.num_draft_tokens
    end = min(seq["ids"].shape[0], int(anchors.max()) + k + 1)
    keep = torch.zeros(k, end, dtype=torch.bool)
    keep[0] = True                            # the real prefix; copy m at anchor + m drafts m + 1
    for m in range(1, k):
        p = anchors + m
        keep[m, p[p < end]] = True
    keep[:, end - 1] = False
    logits = drafter.train_logits(target, seq["ids"][:end].long(), keep)
    pos, copy = copy_rows(keep)
    ok = torch.zeros(k, end, dtype=torch.bool)
    ok[keep] = draft_guess(drafter, logits) == seq["top_i"][:end][pos][:, 0].long()
    m = torch.arange(k)
    at = (anchors[:, None] + m).clamp(max=end - 1)
    return ok[m[None, :].expand_as(at), at].int().cumprod(1).sum(1)


def walk_evaluate(drafter: PARDDrafter, target, seqs, window: int) -> dict:
    """`evaluate` over the last `window` rows of `seqs` (PARD reads no features)."""
    return evaluate(drafter, target, seqs, window=window)


def arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `sharpdraft train pard`; the defaults are those of the shipped weights
    (checkpoints/pard-smollm2/RECIPE.md, stage 8, less its continuation's LR_SCALE), except the
    draft vocabulary: the whole one, as a public PARD drafter has (the shipped weights were
    converted to it, docs/results/public-architectures.md)."""
    add_common_arguments(p, lr=3e-4, draft_vocab=0)
    p.add_argument("--window", type=int, default=512,
                   help="training window in tokens (recorded as train_context)")
    p.add_argument("--layers", type=int, default=4, help="drafter layers (the target's first)")
    p.add_argument("--draft-tokens", type=int, default=8, help="k, drafts per forward")
    p.add_argument("--keep-rate", type=float, default=0.6,
                   help="conditional token drop: keep probability of a copy row given its ancestor")


def _check(args) -> None:
    check_window(args, args.draft_tokens + 2, "--draft-tokens + 2")


def _build(args, target, tokenizer, train) -> tuple:
    cfg = PARDConfig.from_target(target.config, num_layers=args.layers,
                                 num_draft_tokens=args.draft_tokens, train_context=args.window,
                                 draft_vocab_size=args.draft_vocab or None)
    drafter = with_draft_vocab(PARDDrafter(cfg), target, train["features"])
    return drafter, drafter.init_from_target(target)


def _plan(args, drafter: PARDDrafter, target, train, held, continued: bool) -> Plan:
    return Plan(make_loss(drafter, target, train["features"], args.window, args.keep_rate),
                lambda: evaluate(drafter, target, held["features"], window=args.window))


RECIPE = Recipe("pard", PARDDrafter, arguments, _build, _plan, check=_check,
                context_option="window", anchor_leads=anchor_leads, walk_evaluate=walk_evaluate)
add_arguments = RECIPE.add_arguments
main = RECIPE.main
