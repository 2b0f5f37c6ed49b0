"""`sharpdraft train longspark`: distil a LongSpark drafter from its target, on CPU.

Recipe (the paper's, docs/longspark.md, at CPU scale):

1. Data and cache: the same cached target forwards as `sharpdraft train dflash` (the outputs of
   `evenly_spaced_layers(L, 4)`, which are the inputs of the paired target layers, and the
   target's top-k next-token distributions). The paired layers' keys / values are rebuilt from
   them with the frozen target's norm, k/v projections and RoPE (`LongSparkDrafter.target_kv`).
2. Model: draft layer j starts as its paired target layer, the mask slot as the target's
   embedding of the mask token (`LongSparkDrafter.init_from_target`); the correction starts at 0.
3. Per step: one random training sequence and ``--blocks`` random anchors among its trained
   rows; each round sees its boundary state, the last W target keys before its anchor and the
   summary of all of them (`LongSparkDrafter.block_logits`, teacher forcing: the correction
   reads the true predecessor). Loss per draft i = 1 .. B:
   w_i [lambda CE(x_{t+i}) + (1 - lambda) ||q_i - p_i||_1], lambda = ``--ce-weight`` (0.1),
   w_i = exp(-(i - 1) / ``--gamma``) (4), normalised by the weights of the valid rows; p_i is the
   target's renormalised top-k distribution.
4. Every ``--eval-every`` steps: held-out top-1 agreement per draft position and the acceptance
   proxy tau ~ 1 + E[leading agreeing drafts], the correction reading the target's top-1
   predecessors (what greedy decoding commits while drafts agree); the best checkpoint is kept.
"""
from __future__ import annotations

import argparse

import torch

from ..drafters.common import default_mask_token_id
from ..drafters.longspark import LongSparkConfig, LongSparkDrafter
from .common import draft_guess, drafter_features, sample_anchors
from .losses import (agreement_metrics, feature_scale, l1_distance, position_weights,
                     target_to_draft)
from .loop import Plan, Recipe, add_common_arguments, with_draft_vocab


def round_rows(seq: dict, anchors: torch.Tensor, num_drafts: int) -> tuple:
    """rows (K, B): the target distribution rows anchors + i of slot i (clamped to the
    sequence), and valid (K, B): rows inside the sequence that are training targets."""
    T = seq["ids"].shape[0]
    rows = anchors[:, None] + torch.arange(num_drafts)
    inside = rows < T
    rows = rows.clamp(max=T - 1)
    return rows, inside & seq["trained"][rows]


def paper_loss(logits: torch.Tensor, top_p: torch.Tensor, top_d: torch.Tensor,
               true_d: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
               ce_weight: float) -> torch.Tensor:
    """sum_i w_i [lambda CE(true token) + (1 - lambda) ||q_i - p_i||_1] / sum_i w_i over the
    valid rows. logits (K, B, V); top_p, top_d (K, B, k) (draft ids, -1 outside); true_d (K, B)
    draft id of the true next token (-1: outside the draft vocabulary, CE term dropped)."""
    l1 = l1_distance(logits, top_p, top_d)
    logq = torch.log_softmax(logits.float(), dim=-1)
    ce = -logq.gather(-1, true_d.clamp_min(0)[..., None])[..., 0] * (true_d >= 0)
    w = valid.float() * weights[None]
    return ((ce_weight * ce + (1 - ce_weight) * l1) * w).sum() / w.sum().clamp_min(1e-12)


def round_step(drafter: LongSparkDrafter, target, seq: dict, anchors: torch.Tensor,
               weights: torch.Tensor, t2d, ce_weight: float, teacher: str = "true") -> tuple:
    """(loss, logits, rows, valid) of one sequence's rounds at `anchors`. teacher: "true" (the
    correction reads the true tokens) or "target" (the target's top-1 predecessors)."""
    B = drafter.config.num_drafts
    ids = seq["ids"].long()
    T = ids.shape[0]
    rows, valid = round_rows(seq, anchors, B)
    if teacher == "true":
        pred = ids[rows]
    else:
        top1 = seq["top_i"][:, 0].long()
        pred = torch.cat([ids[anchors][:, None], top1[rows[:, :-1]]], dim=1)
    logits = drafter.block_logits(target, seq["feats"].float(), ids, anchors, pred)
    top_i = seq["top_i"][rows].long()
    nxt = ids[(rows + 1).clamp(max=T - 1)]
    true_d = nxt if t2d is None else t2d[nxt]
    valid = valid & (rows + 1 < T)
    loss = paper_loss(logits, seq["top_p"][rows], top_i if t2d is None else t2d[top_i], true_d,
                      valid, weights, ce_weight)
    return loss, logits, rows, valid


def usable_anchors(seq: dict, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n anchors among the trained rows in [1, T - 2] (a round needs a next token)."""
    trained = seq["trained"].clone()
    trained[-1] = False
    return sample_anchors(trained, n, gen)


@torch.no_grad()
def evaluate(drafter: LongSparkDrafter, target, features, blocks: int, gamma: float,
             ce_weight: float, seed: int = 1234) -> dict:
    """Held-out loss, top-1 agreement per draft position and tau_proxy = 1 + E[leading
    agreeing drafts] over fixed anchors (an untrained row ends the run)."""
    B = drafter.config.num_drafts
    gen = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    w = position_weights(B + 1, gamma)
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    losses, oks, valids = [], [], []
    for s in range(len(features)):
        seq = features[s]
        if seq["ids"].shape[0] < 3 or not bool(seq["trained"][1:-1].any()):
            continue
        anchors = usable_anchors(seq, blocks, gen)
        loss, logits, rows, valid = round_step(drafter, target, seq, anchors, w, t2d, ce_weight,
                                               teacher="target")
        losses.append(float(loss))
        oks.append((draft_guess(drafter, logits) == seq["top_i"][rows][..., 0].long()) & valid)
        valids.append(valid)
    return agreement_metrics(losses, oks, valids)


def make_loss(drafter: LongSparkDrafter, target, features, *, blocks: int, gamma: float,
              ce_weight: float):
    """loss_fn(gen, frac) for `loop.fit`: `blocks` rounds of one random training sequence."""
    w = position_weights(drafter.config.num_drafts + 1, gamma)
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    draw = features.sampler(min_length=2, first_row=1)

    def loss_fn(gen, frac):
        seq = draw(gen)
        anchors = usable_anchors(seq, blocks, gen)
        loss, _, _, valid = round_step(drafter, target, seq, anchors, w, t2d, ce_weight)
        return loss, {"rows": int(valid.sum())}
    return loss_fn


def anchor_leads(drafter: LongSparkDrafter, target, seq: dict, anchors: torch.Tensor
                 ) -> torch.Tensor:
    """(A,) int64: at each anchor, how many of the round's greedy drafts, in order, equal the
    target's top-1 along the text (teacher forced, the correction reading the target's top-1
    predecessors; `seq` a cached sequence of raw features with its "layer_ids")."""
    ids = seq["ids"].long()
    rows, valid = round_rows(seq, anchors, drafter.config.num_drafts)
    top1 = seq["top_i"][:, 0].long()
    pred = torch.cat([ids[anchors][:, None], top1[rows[:, :-1]]], dim=1)  # greedy predecessors
    logits = drafter.block_logits(target, drafter_features(drafter, seq), ids, anchors, pred)
    ok = (draft_guess(drafter, logits) == top1[rows]) & valid
    return ok.int().cumprod(-1).sum(-1)


def arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `sharpdraft train longspark`; the defaults are those of the shipped weights
    (checkpoints/longspark-smollm2/RECIPE.md, stage 5, less its continuation's LR_SCALE)."""
    add_common_arguments(p, lr=4e-4, eval_every=500)
    p.add_argument("--blocks", type=int, default=24, help="drafting rounds per sequence and step")
    p.add_argument("--drafts", type=int, default=7, help="B, slots and drafts per round")
    p.add_argument("--layers", type=int, default=4,
                   help="draft layers (each paired with one of evenly spaced target layers)")
    p.add_argument("--window", type=int, default=256, help="W, recent target KV rows read")
    p.add_argument("--summary", type=int, default=16, help="R, summary queries per KV head")
    p.add_argument("--rank", type=int, default=32, help="rank of the Markov correction")
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="lambda: weight of the cross-entropy on the true token (the rest is the "
                        "L1 distance to the target distribution)")
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight decay along the drafts")
    p.add_argument("--eval-blocks", type=int, default=32)


def _build(args, target, tokenizer, train) -> tuple:
    cfg = LongSparkConfig.from_target(
        target.config, mask_token_id=default_mask_token_id(tokenizer), num_layers=args.layers,
        num_drafts=args.drafts, window=args.window, summary_size=args.summary,
        correction_rank=args.rank, train_context=args.seq_len,
        draft_vocab_size=args.draft_vocab or None)
    drafter = with_draft_vocab(LongSparkDrafter(cfg), target, train["features"])
    init_layers = drafter.init_from_target(target)
    with torch.no_grad():
        drafter.boundary_scale.copy_(feature_scale(train["features"].feature_rows()))
    return drafter, init_layers


def _plan(args, drafter: LongSparkDrafter, target, train, held, continued: bool) -> Plan:
    loss_fn = make_loss(drafter, target, train["features"], blocks=args.blocks,
                        gamma=args.gamma, ce_weight=args.ce_weight)
    return Plan(loss_fn, lambda: evaluate(drafter, target, held["features"], args.eval_blocks,
                                          args.gamma, args.ce_weight))


RECIPE = Recipe("longspark", LongSparkDrafter, arguments, _build, _plan, layers_option="layers",
                eval_at_start=True, anchor_leads=anchor_leads)
add_arguments = RECIPE.add_arguments
main = RECIPE.main
