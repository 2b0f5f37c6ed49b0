"""`sharpdraft train dflash`: distil a DFlash drafter from its target, on CPU.

Recipe:

1. Data and cache (`training.cache`): target responses of the self-distilled corpus
   (``--corpus``; the prompt is context, rows whose next token is a response token are trained)
   or packed raw text; one target forward per sequence gives the drafter's context features
   (the outputs of `evenly_spaced_layers(L, 4)`, float16) and the target's top-k next-token
   distribution at every position.
2. Per step: one random training sequence and ``--blocks`` random anchors among its trained
   rows; each block is the anchor token followed by b - 1 mask tokens and sees the context
   before its anchor plus its whole block (the block-attention training mask of
   `DFlashDrafter.block_logits`). Row j of a block is trained against the target's distribution
   for position anchor + j (soft cross-entropy on the renormalised top-k), weighted by
   exp(-(j - 1) / gamma) and only where that row is a training target. A context curriculum
   (``--anchor-warmup``) first restricts anchors to the first tokens of the sequence.
3. Every ``--eval-every`` steps: held-out top-1 agreement per block position and the acceptance
   proxy tau ~ 1 + E[leading agreeing positions]; the best checkpoint (drafter weights only,
   bfloat16 by default, the training feature scale folded into `fc`) is kept.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from ..drafters.common import default_mask_token_id
from ..drafters.dflash import DFlashConfig, DFlashDrafter
from .common import draft_guess, drafter_features, sample_anchors
from .losses import (agreement_metrics, distill_loss, feature_scale, position_weights,
                     target_to_draft)
from .loop import (Plan, Recipe, add_common_arguments, add_position_skip_arguments,
                   skipped_positions, with_draft_vocab)


def block_batch(seq: dict, anchors: torch.Tensor, block_size: int, mask_id: int):
    """block_ids (K, b), target rows (K, b - 1) = positions anchor + j - 1 (j >= 1, clamped to
    the sequence) and valid (K, b - 1): rows inside the sequence that are training targets."""
    ids, trained = seq["ids"], seq["trained"]
    T = ids.shape[0]
    block = torch.full((len(anchors), block_size), mask_id, dtype=torch.long)
    block[:, 0] = ids[anchors].long()
    rows = anchors[:, None] + torch.arange(0, block_size - 1)
    inside = rows < T
    rows = rows.clamp(max=T - 1)
    return block, rows, inside & trained[rows]


def block_step(drafter: DFlashDrafter, target, seq: dict, anchors: torch.Tensor,
               weights: torch.Tensor, t2d, scale: Optional[torch.Tensor],
               positions: Optional[torch.Tensor] = None):
    """(loss, per-row cross-entropy, logits of rows 1.., target rows, valid) of one sequence's
    blocks at `anchors` (context RoPE positions `positions`, None: 0 .. T - 1)."""
    block, rows, valid = block_batch(seq, anchors, drafter.config.block_size,
                                     drafter.config.mask_token_id)
    feats = seq["feats"].float()
    if scale is not None:
        feats = feats * scale
    logits = drafter.block_logits(target, feats, block, anchors, positions)[:, 1:]
    top_i = seq["top_i"][rows].long()
    loss, per_row = distill_loss(logits, seq["top_p"][rows],
                                 top_i if t2d is None else t2d[top_i], weights, valid)
    return loss, per_row, logits, top_i, valid


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target, features, blocks: int, gamma: float,
             seed: int = 1234, scale: Optional[torch.Tensor] = None) -> dict:
    """Held-out metrics with fixed anchors (trained rows only): loss, top-1 agreement per block
    position, and tau_proxy = 1 + E[number of leading agreeing rows] (a row outside the
    sequence or not trained ends the run)."""
    b = drafter.config.block_size
    gen = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    w = position_weights(b, gamma)
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    losses, oks, valids = [], [], []
    for s in range(len(features)):
        seq = features[s]
        if not bool(seq["trained"][1:].any()):
            continue
        anchors = sample_anchors(seq["trained"], blocks, gen)
        loss, _, logits, top_i, valid = block_step(drafter, target, seq, anchors, w, t2d, scale)
        losses.append(float(loss))
        oks.append((draft_guess(drafter, logits) == top_i[..., 0]) & valid)     # (K, b - 1)
        valids.append(valid)
    return agreement_metrics(losses, oks, valids)


def make_loss(drafter: DFlashDrafter, target, features, *, blocks: int, gamma: float,
              scale: Optional[torch.Tensor], anchor_warmup: float = 0.0, min_context: int = 32,
              position_skip: float = 0.0, max_position: Optional[int] = None):
    """loss_fn(gen, frac) for `loop.fit`: a random training sequence, `blocks` anchors among its
    trained rows (the context curriculum lets anchors reach past `min_context` only as frac
    grows to `anchor_warmup`); with probability `position_skip` the sequence's positions skip
    forward (`skipped_positions` up to `max_position`, position-robust training)."""
    if position_skip > 0 and max_position is None:
        raise ValueError("position_skip needs max_position")
    w = position_weights(drafter.config.block_size, gamma)
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    draw = features.sampler(min_length=1, first_row=1)

    def loss_fn(gen, frac):
        seq = draw(gen)
        T = seq["ids"].shape[0]
        max_anchor = None
        if anchor_warmup > 0:
            max_anchor = int(min_context + (T - min_context) * min(1.0, frac / anchor_warmup))
        positions = None                     # (anchors < T: the last row is never trained)
        if position_skip > 0 and float(torch.rand((), generator=gen)) < position_skip:
            positions = skipped_positions(T, max_position - drafter.config.block_size, gen)
        anchors = sample_anchors(seq["trained"], blocks, gen, max_anchor)
        loss, _, _, _, valid = block_step(drafter, target, seq, anchors, w, t2d, scale,
                                          positions)
        return loss, {"rows": int(valid.sum()), "skipped": positions is not None}
    return loss_fn


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
        # a q/k-normed drafter from a target without q/k norms keeps its norms at 1
        missing, unexpected = mine.load_state_dict(layers[idx].state_dict(), strict=False)
        if unexpected or any(".q_norm." not in k and ".k_norm." not in k for k in missing):
            raise ValueError(f"init_from_target: target layer {idx} does not fit drafter layer "
                             f"(missing {missing}, unexpected {unexpected})")
    drafter.norm.load_state_dict(target.model.norm.state_dict())
    if where == "early":
        h = drafter.config.target_hidden_size
        with torch.no_grad():
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, :h].copy_(torch.eye(h, drafter.config.hidden_size).T)
            drafter.hidden_norm.weight.copy_(layers[0].input_layernorm.weight)
    return chosen


def folded_drafter(drafter: DFlashDrafter, scale: Optional[torch.Tensor]) -> DFlashDrafter:
    """A copy of `drafter` whose fc reads raw features (feature scale folded into its weight)."""
    snapshot = DFlashDrafter(drafter.config)
    snapshot.load_state_dict(drafter.state_dict())
    if scale is not None:
        with torch.no_grad():
            snapshot.fc.weight.mul_(scale[None, :].to(snapshot.fc.weight.dtype))
    return snapshot.eval()


def anchor_leads(drafter: DFlashDrafter, target, seq: dict, anchors: torch.Tensor
                 ) -> torch.Tensor:
    """(A,) int64: at each anchor, how many of the block's greedy drafts, in order, equal the
    target's top-1 along the text (teacher forced, one parallel forward; `seq` a cached
    sequence of raw features with its "layer_ids"; a row outside the sequence or not trained
    ends the run)."""
    block, rows, valid = block_batch(seq, anchors, drafter.config.block_size,
                                     drafter.config.mask_token_id)
    logits = drafter.block_logits(target, drafter_features(drafter, seq), block, anchors)[:, 1:]
    ok = (draft_guess(drafter, logits) == seq["top_i"][rows][..., 0].long()) & valid
    return ok.int().cumprod(-1).sum(-1)


def arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `sharpdraft train dflash`; the defaults are those of the shipped weights
    (checkpoints/dflash-smollm2/RECIPE.md, stage 12, less its continuation's lower --lr) in the
    public z-lab architecture the shipped weights were moved to: q/k norms, the whole vocabulary
    (docs/results/public-architectures.md)."""
    add_common_arguments(p, lr=1e-3, draft_vocab=0)
    p.add_argument("--blocks", type=int, default=64, help="draft blocks per sequence and step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--features", type=int, default=4, help="target layers read as context")
    p.add_argument("--gamma", type=float, default=2.0, help="loss weight decay along the block")
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--init", choices=["early", "late", "random"], default="early",
                   help="start the drafter from the target's first layers (early), its last "
                        "layers (late), or randomly (see init_from_target)")
    p.add_argument("--anchor-warmup", type=float, default=0.0,
                   help="fraction of the run over which anchors grow from --min-context to "
                        "the sequence length (context curriculum; 0 = off)")
    p.add_argument("--min-context", type=int, default=32)
    p.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="RMSNorm each head's queries and keys (the public z-lab DFlash "
                        "architecture; with --draft-vocab 0 the drafter exports exactly)")
    add_position_skip_arguments(p, default=0.5)


def _build(args, target, tokenizer, train) -> tuple:
    cfg = DFlashConfig.from_target(
        target.config, mask_token_id=default_mask_token_id(tokenizer), num_layers=args.layers,
        block_size=args.block_size, num_features=args.features, train_context=args.seq_len,
        draft_vocab_size=args.draft_vocab or None, qk_norm=args.qk_norm)
    drafter = with_draft_vocab(DFlashDrafter(cfg), target, train["features"])
    init_layers = init_from_target(drafter, target, args.init) if args.init != "random" else None
    return drafter, init_layers


def _plan(args, drafter: DFlashDrafter, target, train, held, continued: bool) -> Plan:
    tr = train["features"]
    # a continued checkpoint's fc already reads raw features: no second feature scale
    scale = None if continued else feature_scale(tr.feature_rows())
    loss_fn = make_loss(drafter, target, tr, blocks=args.blocks, gamma=args.gamma, scale=scale,
                        anchor_warmup=args.anchor_warmup, min_context=args.min_context,
                        position_skip=args.position_skip,
                        max_position=args.max_position or target.config.max_position_embeddings)
    return Plan(loss_fn, lambda: evaluate(drafter, target, held["features"], args.eval_blocks,
                                          args.gamma, scale=scale),
                snapshot=lambda: folded_drafter(drafter, scale))


RECIPE = Recipe("dflash", DFlashDrafter, arguments, _build, _plan, layers_option="features",
                anchor_leads=anchor_leads)
add_arguments = RECIPE.add_arguments
main = RECIPE.main
