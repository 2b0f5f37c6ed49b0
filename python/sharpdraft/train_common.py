"""Shared pieces of the EAGLE-3 and PARD training recipes: options, the cached data, and the
optimisation loop (AdamW, warm-up then cosine decay over the steps or a time budget, periodic
held-out evaluation keeping the best checkpoint, a JSONL log and a tqdm bar)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from .drafters.dflash import evenly_spaced_layers
from .train_dflash import _cache_for, lr_at


def add_common_arguments(p: argparse.ArgumentParser, *, lr: float, window: int) -> None:
    """Options every recipe shares (data, cache, schedule, output, runtime)."""
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=131072, help="training tokens to cache")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens to cache")
    p.add_argument("--seq-len", type=int, default=1024, help="cached sequence length")
    p.add_argument("--window", type=int, default=window,
                   help="training window in tokens (recorded as train_context)")
    p.add_argument("--topk", type=int, default=32, help="cached target probabilities per position")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft vocabulary size (0: the whole target vocabulary)")
    p.add_argument("--steps", type=int, default=2000,
                   help="optimiser steps (the schedule's length)")
    p.add_argument("--lr", type=float, default=lr, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--eval-every", type=int, default=200,
                   help="held-out evaluation (and best-checkpoint) period in steps")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the saved weights")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="time budget of the training loop (the cosine schedule ends with it)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation seed")


def load_data(args, target, tokenizer, provenance):
    """Train and held-out caches: the same cache as `sharpdraft train dflash` (its default
    feature layers), so one set of target forwards serves every drafter."""
    if not 2 <= args.window <= args.seq_len:
        raise SystemExit(f"--window must lie in [2, --seq-len={args.seq_len}], got {args.window}")
    layer_ids = evenly_spaced_layers(target.config.num_hidden_layers, 4)
    train_c = _cache_for(target, tokenizer, provenance, layer_ids, args, "train", args.tokens)
    eval_c = _cache_for(target, tokenizer, provenance, layer_ids, args, "heldout",
                        args.eval_tokens)
    return layer_ids, train_c, eval_c


def fit(drafter, target, loss_fn: Callable, eval_fn: Callable, *, steps: int, lr: float,
        warmup: int, eval_every: int, out: Optional[Path], save_dtype: torch.dtype,
        max_seconds: Optional[float], seed: int = 0, weight_decay: float = 0.01,
        grad_clip: float = 1.0, meta: Optional[dict] = None, desc: str = "training") -> dict:
    """Train `drafter` in place.

    loss_fn(gen) -> (loss tensor, dict of extra log fields): one step's loss on a batch drawn
    with the torch.Generator `gen`. eval_fn() -> dict with at least "loss" and "tau_proxy": the
    held-out evaluation; the checkpoint with the best tau_proxy is written to `out` (drafter
    weights in `save_dtype`, plus training.json).

    Returns {"history", "evals", "best", "steps_done", "seconds"}.
    """
    for p in target.parameters():
        p.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    history, evals, best = [], [], None
    t0 = time.time()
    log = open(out / "train_log.jsonl", "a") if out else None

    def write(rec):
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    def do_eval(step):
        nonlocal best
        was = drafter.training
        drafter.eval()
        ev = {"step": step, "elapsed_s": round(time.time() - t0, 1), **eval_fn()}
        drafter.train(was)
        evals.append(ev)
        write({"eval": ev})
        tqdm.write(f"eval step {step}: loss {ev['loss']:.3f} tau~{ev['tau_proxy']:.3f} top1 "
                   f"{' '.join(f'{x:.2f}' for x in ev['top1_per_position'])}", file=sys.stderr)
        if best is None or ev["tau_proxy"] > best["tau_proxy"]:
            best = ev
            if out is not None:
                snap = type(drafter)(drafter.config)
                snap.load_state_dict(drafter.state_dict())
                snap.to(save_dtype).save(out)
                (out / "training.json").write_text(json.dumps(
                    {**(meta or {}), "best_eval": ev, "evals": evals}, indent=2) + "\n")

    drafter.train()
    bar = tqdm(range(steps), desc=desc, unit="step", file=sys.stderr)
    step = 0
    for step in bar:
        if step and step % eval_every == 0:
            do_eval(step)
        frac = (time.time() - t0) / max_seconds if max_seconds else 0.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup, frac)
        loss, extra = loss_fn(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        rec = {"step": step, "loss": round(float(loss.detach()), 4), **extra,
               "grad_norm": round(float(gnorm), 3), "lr": opt.param_groups[0]["lr"],
               "elapsed_s": round(time.time() - t0, 1)}
        history.append(rec)
        if step % 10 == 0:
            write(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")
        if max_seconds is not None and time.time() - t0 > max_seconds:
            tqdm.write(f"time budget reached after {step + 1} steps", file=sys.stderr)
            break
    bar.close()
    do_eval(step + 1)
    if log:
        log.close()
    return {"history": history, "evals": evals, "best": best, "steps_done": step + 1,
            "seconds": time.time() - t0}


def finish(out: Path, meta: dict, result: dict) -> dict:
    """Write training.json (meta, steps, time, best and all evaluations) and print a summary."""
    summary = {**meta, "steps_done": result["steps_done"],
               "train_seconds": round(result["seconds"], 1), "best_eval": result["best"],
               "evals": result["evals"]}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("steps_done", "train_seconds", "best_eval")},
                     indent=2))
    return summary


def run_meta(args, provenance, drafter, init_layers, train_c) -> dict:
    return {"command": "sharpdraft " + " ".join(sys.argv[1:]) if sys.argv else None,
            "args": vars(args), "target": provenance,
            "drafter_params": sum(p.numel() for p in drafter.parameters()),
            "init_from_target_layers": init_layers,
            "train_tokens_per_source": train_c["meta"]["tokens_per_source"]}
