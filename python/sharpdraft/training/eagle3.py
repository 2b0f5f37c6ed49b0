"""`sharpdraft train eagle3`: train an EAGLE-3 drafter from its target, on CPU.

Recipe:

1. Data and cache: the same cached target forwards as `sharpdraft train dflash` (layer outputs
   of `evenly_spaced_layers(L, 4)`, float16, and the target's top-k next-token distributions).
   EAGLE-3 fuses three of the cached layers: the lowest, the one nearest L / 2, and the highest
   (SmolLM2-135M: 1, 19, 28; the reference's 2, 15, 27 are not cached).
2. Model (`drafters.eagle3`): one decoder layer at the target's width, random start; a reduced
   draft vocabulary (``--draft-vocab`` most frequent target ids) read through the target's LM
   head; per-dimension feature scale 1 / RMS (tames SmolLM2's massive activations) stored in the
   checkpoint.
3. Objective: training-time test over a random window of up to ``--window`` tokens that reaches
   the sequence's trained rows: ``--ttt-steps`` drafting depths, depth d feeding each row its
   own depth d - 1 output and the token d places further; soft cross-entropy against the
   target's renormalised top-k distribution on trained rows, weighted by ``--depth-decay`` ** d.
   Prompt rows serve as depth-0 keys only: the deeper depths and the LM head run on the rows
   with a trained target (1.8x faster forward and backward on corpus windows, same losses).
   ``--position-skip P``: a share P of the windows get skipped position ids (one random forward
   gap, PoSE-style), so distances up to the target's context are trained with short windows.
4. Every ``--eval-every`` steps: held-out top-1 agreement per depth and the chain acceptance
   proxy tau ~ 1 + E[leading agreeing depths] over ``chain_length`` depths, on the last
   ``window`` tokens of every held-out sequence; the best checkpoint is kept.
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from ..drafters.eagle3 import Eagle3Config, Eagle3Drafter
from .common import draft_guess, drafter_features, fused_columns, last_windows, window_start
from .losses import decoding_walk, feature_scale, soft_cross_entropy, target_to_draft, trained_ahead
from .loop import (Plan, Recipe, add_common_arguments, add_position_skip_arguments, check_window,
                   skipped_positions, with_draft_vocab)


def depth_losses(drafter: Eagle3Drafter, target, seq: dict, off: int, window: int, steps: int,
                 cols: torch.Tensor, t2d, positions: Optional[torch.Tensor] = None,
                 trained_only: bool = False):
    """Per depth d: (soft cross-entropy (n_d,), valid (n_d,) bool, logits (n_d, V), target
    top-1 ids (n_d,)) of one window of one sequence (RoPE positions of the window's rows
    `positions`, None: 0 .. window - 1). trained_only: draft only the rows t whose target
    t + d + 1 is a trained row at some depth d < steps (`Eagle3Drafter.ttt_logits` rows: the
    same losses on valid rows, a fraction of the compute when the window is mostly prompt);
    n_d then counts those rows."""
    sl = slice(off, off + window)
    ids = seq["ids"][sl].long()
    feats = seq["feats"][sl][:, cols].float()
    top_p, top_i, trained = seq["top_p"][sl], seq["top_i"][sl].long(), seq["trained"][sl]
    T = ids.shape[0]
    rows = None
    if trained_only:     # row t is wanted when any of its targets t + 1 .. t + steps is trained
        rows = torch.nonzero(trained_ahead(trained[1:], steps)).flatten()
    out = []
    for d, lg in enumerate(drafter.ttt_logits(target, feats, ids, steps, positions, rows)):
        at = (torch.arange(1 + d, 1 + d + lg.shape[0], device=ids.device) if rows is None
              else rows[rows < T - 1 - d] + 1 + d)  # the target's distribution at t + d + 1
        ti = top_i[at]
        ce = soft_cross_entropy(lg, top_p[at], ti if t2d is None else t2d[ti])
        out.append((ce, trained[at], lg, ti[:, 0]))
    return out


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    v = valid.to(x.dtype)
    return (x * v).sum() / v.sum().clamp_min(1.0)


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, target, features, cols: torch.Tensor, window: int = 512,
             depth_decay: float = 0.8) -> dict:
    """Held-out metrics over the last `window` tokens of every sequence, chain_length depths,
    trained rows only: loss (depth-weighted), top1_per_position (depth d's agreement with the
    target's top-1), tau_proxy = 1 + mean over rows of the number of leading agreeing depths
    (an untrained row ends the run) and tau_walk, the tau of greedy decoding's own walk over
    those rows (`losses.decoding_walk`: steps start just after a rejection, not at every row)."""
    K = drafter.config.chain_length
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    w = torch.tensor([depth_decay ** d for d in range(K)])
    losses, hits, counts, lead, walks = [], torch.zeros(K), torch.zeros(K), [], []
    for seq, W, off in last_windows(features, window, K + 1):
        per = depth_losses(drafter, target, seq, off, W, K, cols, t2d)
        losses.append(float((torch.stack([masked_mean(ce, v) for ce, v, _, _ in per]) * w).sum()
                            / w.sum()))
        oks = []
        for d, (_, v, lg, top1) in enumerate(per):
            ok = (draft_guess(drafter, lg) == top1) & v
            hits[d] += ok.sum()
            counts[d] += v.sum()
            oks.append(ok)
        n = oks[-1].shape[0]
        start = per[0][1][:n]                       # runs start at trained rows
        runs = torch.stack([o[:n] for o in oks], 1).int().cumprod(1).sum(1).float()
        lead.append(runs[start])
        walks.append(decoding_walk(runs, start))
    a = hits / counts.clamp_min(1.0)
    return {"loss": sum(losses) / len(losses),
            "top1_per_position": [round(float(x), 4) for x in a],
            "top1_mean": float(a.mean()), "tau_proxy": 1.0 + float(torch.cat(lead).mean()),
            "tau_walk": float(torch.cat(walks).mean())}


def make_loss(drafter: Eagle3Drafter, target, features, cols: torch.Tensor, window: int,
              ttt_steps: int, depth_decay: float, position_skip: float = 0.0,
              max_position: Optional[int] = None):
    """loss_fn(gen, frac) for `loop.fit`: training-time test over a random window of a random
    training sequence, per-depth mean soft cross-entropy on trained rows, weighted by
    depth_decay ** d; with probability `position_skip` the window's positions skip forward
    (`loop.skipped_positions` up to `max_position`, position-robust training)."""
    if position_skip > 0 and max_position is None:
        raise ValueError("position_skip needs max_position")
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    w = torch.tensor([depth_decay ** d for d in range(ttt_steps)])
    draw = features.sampler(min_length=ttt_steps + 1)

    def loss_fn(gen, frac):
        seq = draw(gen)
        W = min(window, seq["ids"].shape[0])
        off = window_start(seq["trained"], W, gen)
        positions = None
        if position_skip > 0 and float(torch.rand((), generator=gen)) < position_skip:
            positions = skipped_positions(W, max_position - ttt_steps, gen)
        per = depth_losses(drafter, target, seq, off, W, ttt_steps, cols, t2d, positions,
                           trained_only=True)
        per_depth = torch.stack([masked_mean(ce, v) for ce, v, _, _ in per])
        return (per_depth * w).sum() / w.sum(), {
            "per_depth": [round(float(x), 3) for x in per_depth.detach()],
            "rows": int(per[0][1].sum()), "skipped": positions is not None}
    return loss_fn


def anchor_leads(drafter: Eagle3Drafter, target, seq: dict, anchors: torch.Tensor
                 ) -> torch.Tensor:
    """(A,) int64: at each anchor, how many of the chain's greedy drafts (chain_length depths
    of the training-time test), in order, equal the target's top-1 along the text (teacher
    forced; `seq` a cached sequence of raw features with its "layer_ids")."""
    K = drafter.config.chain_length
    end = min(seq["ids"].shape[0], int(anchors.max()) + K + 2)
    logits = drafter.ttt_logits(target, drafter_features(drafter, seq)[:end],
                                seq["ids"][:end].long(), K)
    top1 = seq["top_i"][:end, 0].long()
    ok = []
    for d, lg in enumerate(logits):     # depth d, row t = anchor - 1: token anchor + d + 1
        t = (anchors - 1).clamp(max=lg.shape[0] - 1)
        hit = (draft_guess(drafter, lg[t]) == top1[(t + 1 + d).clamp(max=end - 1)])
        ok.append(hit & (anchors - 1 < lg.shape[0]))
    return torch.stack(ok, 1).int().cumprod(1).sum(1)


def walk_evaluate(drafter: Eagle3Drafter, target, seqs, window: int) -> dict:
    """`evaluate` on sequences whose features are exactly the drafter's fused layers."""
    width = seqs[0]["feats"].shape[1]
    return evaluate(drafter, target, seqs, torch.arange(width), window=window)


def arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `sharpdraft train eagle3`; the defaults are those of the shipped weights
    (checkpoints/eagle3-smollm2/RECIPE.md, stage 11, less its continuation's LR_SCALE)."""
    add_common_arguments(p, lr=1e-3)
    p.add_argument("--window", type=int, default=512,
                   help="training window in tokens (recorded as train_context)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="drafting depths simulated per step (training-time test)")
    p.add_argument("--depth-decay", type=float, default=0.8, help="loss weight ratio per depth")
    p.add_argument("--chain-length", type=int, default=5, help="drafts per step (chain mode)")
    add_position_skip_arguments(p)


def _check(args) -> None:
    check_window(args, args.chain_length + 2, "--chain-length + 2")


def _fused_layers(cached, num_layers: int) -> list:
    """The three cached layers EAGLE-3 fuses: the lowest, the one nearest L / 2, the highest."""
    return [cached[0], min(cached, key=lambda l: abs(l - num_layers // 2)), cached[-1]]


def _build(args, target, tokenizer, train) -> tuple:
    chosen = _fused_layers(train["meta"]["layer_ids"], target.config.num_hidden_layers)
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=chosen,
                                   train_context=args.window, chain_length=args.chain_length,
                                   draft_vocab_size=args.draft_vocab or None)
    return with_draft_vocab(Eagle3Drafter(cfg), target, train["features"]), None


def _plan(args, drafter: Eagle3Drafter, target, train, held, continued: bool) -> Plan:
    tr = train["features"]
    chosen = list(drafter.config.target_layer_ids)
    cols = fused_columns(train["meta"]["layer_ids"], chosen, target.config.hidden_size)
    if not continued:         # a continued checkpoint's feature scale is one of its buffers
        with torch.no_grad():
            drafter.feature_scale.copy_(feature_scale(tr.feature_rows()[:, cols]))
    loss_fn = make_loss(drafter, target, tr, cols, args.window, args.ttt_steps,
                        args.depth_decay, position_skip=args.position_skip,
                        max_position=args.max_position or target.config.max_position_embeddings)
    return Plan(loss_fn, lambda: evaluate(drafter, target, held["features"], cols,
                                          window=args.window, depth_decay=args.depth_decay),
                note=f", fused target layers {chosen}")


RECIPE = Recipe("eagle3", Eagle3Drafter, arguments, _build, _plan, check=_check,
                context_option="window", anchor_leads=anchor_leads, walk_evaluate=walk_evaluate)
add_arguments = RECIPE.add_arguments
main = RECIPE.main
