"""`sharpdraft train eagle3`: train an EAGLE-3 drafter from the target on real text, on CPU.

Recipe:

1. Data and cache: the packed sequences and cached target forwards of `sharpdraft train dflash`
   (layer outputs of layers evenly_spaced_layers(L, 4), float16, and the target's top-k
   next-token probabilities). EAGLE-3 fuses three of the cached layers: the lowest, the one
   nearest L / 2, and the highest (SmolLM2-135M: 1, 19, 28; the reference's 2, 15, 27 are not
   cached).
2. Model (``drafters.eagle3``): one decoder layer at the target's width, random start; a reduced
   draft vocabulary (``--draft-vocab`` most frequent target ids) read through the target's LM
   head; per-dimension feature scale 1 / RMS (tames SmolLM2's massive activations) stored in the
   checkpoint.
3. Objective: training-time test over a random window of ``--window`` tokens: ``--ttt-steps``
   drafting depths, depth d feeding each row its own depth d - 1 output and the token d places
   further; soft cross-entropy against the target's renormalised top-k distribution at each
   depth, weighted by ``--depth-decay`` ** d. AdamW, warm-up then cosine decay.
4. Every ``--eval-every`` steps: held-out top-1 agreement per depth and the chain acceptance
   proxy tau ~ 1 + E[leading agreeing depths] over ``chain_length`` depths; the best checkpoint
   is kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict

import torch

from .drafters.eagle3 import Eagle3Config, Eagle3Drafter
from .train_common import add_common_arguments, finish, fit, load_data, run_meta
from .train_dflash import draft_vocabulary, feature_scale, soft_cross_entropy, target_to_draft


def fused_columns(cached_layers, chosen, width: int) -> torch.Tensor:
    """Column indices of the `chosen` layers inside features cached for `cached_layers`."""
    return torch.cat([torch.arange(cached_layers.index(l) * width,
                                   (cached_layers.index(l) + 1) * width) for l in chosen])


def depth_losses(drafter: Eagle3Drafter, target, cache: Dict[str, torch.Tensor], s: int,
                 off: int, window: int, steps: int, cols: torch.Tensor, t2d):
    """Per-depth soft cross-entropy (list of (n_d,)) and logits of one window."""
    ids = cache["ids"][s, off:off + window].long()
    feats = cache["feats"][s, off:off + window][:, cols].float()
    logits = drafter.ttt_logits(target, feats, ids, steps)
    ce = []
    for d, lg in enumerate(logits):
        rows = slice(1 + d, 1 + d + lg.shape[0])   # target's distribution at t + d + 1
        top_i = cache["top_i"][s, off:off + window][rows].long()
        ce.append(soft_cross_entropy(lg, cache["top_p"][s, off:off + window][rows],
                                     top_i if t2d is None else t2d[top_i]))
    return ce, logits


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, target, cache: Dict[str, torch.Tensor], cols: torch.Tensor,
             window: int = 512, depth_decay: float = 0.8) -> dict:
    """Held-out metrics over the first `window` tokens of every sequence, chain_length depths:
    loss (depth-weighted), top1_per_position (depth d's agreement with the target's top-1) and
    tau_proxy = 1 + mean over rows of the number of leading agreeing depths."""
    K = drafter.config.chain_length
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    losses, agree, lead = [], [], []
    w = torch.tensor([depth_decay ** d for d in range(K)])
    for s in range(cache["ids"].shape[0]):
        ce, logits = depth_losses(drafter, target, cache, s, 0, window, K, cols, t2d)
        losses.append(float((torch.stack([c.mean() for c in ce]) * w).sum() / w.sum()))
        oks = []
        for d, lg in enumerate(logits):
            guess = lg.argmax(-1) if drafter.d2t is None else drafter.d2t[lg.argmax(-1)]
            top1 = cache["top_i"][s, 1 + d:1 + d + lg.shape[0], 0].long()
            oks.append(guess == top1)
        agree.append(torch.stack([o.float().mean() for o in oks]))
        n = oks[-1].shape[0]
        lead.append(torch.stack([o[:n] for o in oks], 1).int().cumprod(1).sum(1).float())
    a = torch.stack(agree).mean(0)
    return {"loss": sum(losses) / len(losses),
            "top1_per_position": [round(float(x), 4) for x in a],
            "top1_mean": float(a.mean()), "tau_proxy": 1.0 + float(torch.cat(lead).mean())}


def make_loss(drafter: Eagle3Drafter, target, cache: Dict[str, torch.Tensor],
              cols: torch.Tensor, window: int, ttt_steps: int, depth_decay: float):
    """loss_fn(gen) for `train_common.fit`: training-time test over a random window of a random
    cached sequence, per-depth mean soft cross-entropy weighted by depth_decay ** d."""
    t2d = target_to_draft(drafter.d2t, target.get_output_embeddings().weight.shape[0])
    n_seq, T = cache["ids"].shape
    w = torch.tensor([depth_decay ** d for d in range(ttt_steps)])

    def loss_fn(gen):
        s = int(torch.randint(n_seq, (), generator=gen))
        off = int(torch.randint(T - window + 1, (), generator=gen))
        ce, _ = depth_losses(drafter, target, cache, s, off, window, ttt_steps, cols, t2d)
        per_depth = torch.stack([c.mean() for c in ce])
        return (per_depth * w).sum() / w.sum(), {
            "per_depth": [round(float(x), 3) for x in per_depth.detach()]}
    return loss_fn


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, lr=2e-3, window=512)
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="drafting depths simulated per step (training-time test)")
    p.add_argument("--depth-decay", type=float, default=0.8, help="loss weight ratio per depth")
    p.add_argument("--chain-length", type=int, default=5, help="drafts per step (chain mode)")


def main(args: argparse.Namespace) -> dict:
    from .models import load_target

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, tokenizer, provenance = load_target(args.target, dtype=torch.float32)
    cached, train_c, eval_c = load_data(args, target, tokenizer, provenance)
    L = target.config.num_hidden_layers
    chosen = [cached[0], min(cached, key=lambda l: abs(l - L // 2)), cached[-1]]
    cfg = Eagle3Config.from_target(target.config, target_layer_ids=chosen,
                                   train_context=args.window, chain_length=args.chain_length,
                                   draft_vocab_size=args.draft_vocab or None)
    drafter = Eagle3Drafter(cfg)
    tr = train_c["tensors"]
    vocab = target.get_output_embeddings().weight.shape[0]
    if cfg.draft_vocab_size is not None:
        drafter.set_draft_vocab(draft_vocabulary(tr, cfg.draft_vocab_size, vocab))
    cols = fused_columns(cached, chosen, target.config.hidden_size)
    with torch.no_grad():
        drafter.feature_scale.copy_(feature_scale(tr["feats"][..., cols]))
    loss_fn = make_loss(drafter, target, tr, cols, args.window, args.ttt_steps,
                        args.depth_decay)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(args, provenance, drafter, None, train_c)
    print(f"sharpdraft train eagle3: {meta['drafter_params'] / 1e6:.2f}M parameters, fused "
          f"target layers {chosen}", file=sys.stderr)
    result = fit(drafter, target, loss_fn,
                 lambda: evaluate(drafter, target, eval_c["tensors"], cols,
                                  depth_decay=args.depth_decay),
                 steps=args.steps, lr=args.lr, warmup=args.warmup, eval_every=args.eval_every,
                 out=out, save_dtype=getattr(torch, args.save_dtype),
                 max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                 seed=args.seed, meta=meta, desc="training eagle3")
    return finish(out, meta, result)
