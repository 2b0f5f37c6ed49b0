"""The training loop every recipe shares: options, the cached data, AdamW with linear warm-up
then cosine decay over the steps or a time budget (whichever ends first), periodic held-out
evaluation keeping the best checkpoint (written to a temporary folder and renamed), a JSONL log
and a tqdm bar."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn
from tqdm import tqdm

from ..target.precision import choose_autocast
from ..drafters.common import evenly_spaced_layers
from . import card
from .cache import autocast_to, cached_features, complete_cache_dtype
from .losses import draft_vocabulary


def add_common_arguments(p: argparse.ArgumentParser, *, lr: float, seq_len: int = 1024,
                         steps: int = 2000, warmup: int = 30, eval_every: int = 250,
                         draft_vocab: int = 8192) -> None:
    """Options every recipe shares (data, cache, schedule, output, runtime); `lr`, `seq_len`,
    `steps`, `warmup`, `eval_every` and `draft_vocab` are the recipe's defaults of those options
    (those its shipped weights were trained with; draft_vocab 0 where the public architecture
    drafts over the whole vocabulary)."""
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", default=None,
                   help="a self-distilled corpus folder (`sharpdraft data generate`): train on "
                        "its train split's responses (prompts as context) and evaluate on its "
                        "held-out split; default: packed raw text (`sharpdraft.data`)")
    p.add_argument("--eval-corpus", default=None,
                   help="evaluate on the held-out split of this corpus instead (default: "
                        "--corpus's), e.g. to compare runs trained on different corpora")
    p.add_argument("--tokens", type=int, default=131072,
                   help="training tokens to cache (response tokens with --corpus)")
    p.add_argument("--eval-tokens", type=int, default=8192,
                   help="held-out tokens to cache (response tokens with --corpus)")
    p.add_argument("--seq-len", type=int, default=seq_len,
                   help="training context length: packed text sequence length, or the longest "
                        "corpus conversation kept (its last tokens); recorded as train_context")
    p.add_argument("--topk", type=int, default=32, help="cached target probabilities per position")
    p.add_argument("--draft-vocab", type=int, default=draft_vocab,
                   help="draft vocabulary size: the most frequent target tokens of the training "
                        "sequences (0: the whole target vocabulary)")
    p.add_argument("--steps", type=int, default=steps,
                   help="optimiser steps (the schedule's length)")
    p.add_argument("--lr", type=float, default=lr, help="peak AdamW learning rate")
    p.add_argument("--lr-scale", type=float, default=1.0,
                   help="multiplies --lr (continuations of trained weights have used 0.15-0.5); "
                        "training.json records the product as lr")
    p.add_argument("--warmup", type=int, default=warmup, help="linear warm-up steps")
    p.add_argument("--eval-every", type=int, default=eval_every,
                   help="held-out evaluation (and best-checkpoint) period in steps")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the saved weights")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="time budget of the training loop (the cosine schedule ends with it; "
                        "the best checkpoint is kept)")
    p.add_argument("--cache-only", action="store_true",
                   help="build the feature caches and stop (a later run with the same data "
                        "options reuses them)")
    p.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                   help="continue from a drafter checkpoint of this kind (its geometry, draft "
                        "vocabulary and weights; the geometry options are then ignored)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu",
                   help="where the target and the drafter run (cpu, cuda, cuda:N)")
    p.add_argument("--online-features", action="store_true",
                   help="compute the target's features for each step's sequence instead of "
                        "caching them on disk (for a GPU: a cache of millions of rows is tens "
                        "of GB)")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation seed")
    p.add_argument("--autocast", choices=["off", "bfloat16", "auto"], default="off",
                   help="run each training step's forward under torch.autocast in this dtype "
                        "(float32 weights, gradients and AdamW state; bfloat16 matmuls): "
                        "faster where the CPU has AMX or on a GPU, much slower on an AVX2-only "
                        "CPU; auto: bfloat16 where a measurement on this device finds it faster "
                        "(target.precision.choose_autocast); held-out evaluations stay float32")
    p.add_argument("--cache-dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                   help="precision of the target forwards that fill the train split's feature "
                        "cache: bfloat16 runs them under autocast (float32 weights and "
                        "residual stream, bfloat16 matmuls) and is keyed apart from float32; "
                        "auto: the precision of a complete cache of this selection where one "
                        "exists (bfloat16 first), else bfloat16 where measured faster, as "
                        "--autocast auto; the held-out cache is always float32")


def add_position_skip_arguments(p: argparse.ArgumentParser, default: float = 0.0) -> None:
    """--position-skip (default `default`) / --max-position, for recipes with position-robust
    training."""
    p.add_argument("--position-skip", type=float, default=default,
                   help="position-robust training: the share of steps whose context positions "
                        "skip forward (one random gap, PoSE-style) so that distances up to "
                        "--max-position are trained with --seq-len keys (0 = off)")
    p.add_argument("--max-position", type=int, default=None,
                   help="largest position id of --position-skip (default: the target's "
                        "max_position_embeddings)")


def skipped_positions(T: int, max_position: int, gen: torch.Generator) -> torch.Tensor:
    """(T,) increasing position ids with one forward skip (PoSE-style): rows from a random
    split point c in [1, T) on are shifted by a random gap in [0, max_position - T], so a
    T-token sequence shows relative distances up to max_position - 1 while holding T keys (RoPE
    sees only differences, so the shift of a whole sequence changes nothing).

    Raises:
        ValueError: max_position < T.
    """
    if max_position < T:
        raise ValueError(f"max_position {max_position} < sequence length {T}")
    c = 1 + int(torch.randint(max(1, T - 1), (), generator=gen))
    gap = int(torch.randint(max_position - T + 1, (), generator=gen))
    pos = torch.arange(T)
    return pos + gap * (pos >= c)


def init_from_checkpoint(cls, folder, target) -> tuple:
    """(drafter, provenance) of `--init-from`: the checkpoint loaded (checked against the
    target) in training mode, and what its training.json says of how it was made."""
    drafter = cls.load(folder, target=target).float().train()
    info = {"folder": str(folder)}
    record = Path(folder) / "training.json"
    if record.exists():
        t = json.loads(record.read_text())
        info.update({k: t.get(k) for k in ("command", "steps_done", "train_seconds",
                                            "train_data", "train_tokens_per_source")},
                    best_eval=t.get("best_eval", {}).get("tau_proxy"))
    return drafter, info


def check_window(args, least: int, what: str) -> None:
    """Refuse a --window outside [least, --seq-len] (SystemExit naming the flags)."""
    if not least <= args.window <= args.seq_len:
        raise SystemExit(f"--window must lie in [{what}, --seq-len={args.seq_len}], got "
                         f"{args.window}")


def training_device(name: str) -> torch.device:
    """torch.device of --device, checked before any work.

    Raises:
        SystemExit: an unknown device, or a CUDA device this machine does not have.
    """
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise SystemExit(f"--device {name!r}: {err}")
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise SystemExit(f"--device {name}: no such CUDA device here "
                         f"(torch.cuda.is_available() = {torch.cuda.is_available()})")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda[:N], got {name!r}")
    return device


def prepare_run(args, layer_ids: Callable) -> tuple:
    """Threads, seed, the target (float32) and the train / held-out caches of the target layers
    `layer_ids(target)`: (target, tokenizer, provenance, train, held, cache_seconds)."""
    from ..target.loading import load_target

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = training_device(args.device)
    target, tokenizer, provenance = load_target(args.target, dtype=torch.float32)
    target.to(device)
    reuse_cache_dtype(args, tokenizer, provenance, layer_ids(target))
    resolve_precision(args, target)
    t0 = time.time()
    train, held = load_data(args, target, tokenizer, provenance, layer_ids(target))
    return target, tokenizer, provenance, train, held, time.time() - t0


def reuse_cache_dtype(args, tokenizer, provenance, layer_ids: List[int]) -> None:
    """`--cache-dtype auto` with a complete train feature cache of this selection already on
    disk (`cache.complete_cache_dtype`): set args.cache_dtype to its precision, so that no
    timing runs and nothing is rebuilt. Anything else is left to `resolve_precision` and
    `load_data` (which also report a missing corpus)."""
    if getattr(args, "cache_dtype", None) != "auto" or getattr(args, "online_features", False):
        return
    try:
        found = complete_cache_dtype(tokenizer, provenance, layer_ids, split="train",
                                     tokens=args.tokens, seq_len=args.seq_len, topk=args.topk,
                                     seed=args.seed, corpus=args.corpus)
    except (FileNotFoundError, ValueError):
        return
    if found:
        args.cache_dtype = found
        print(f"sharpdraft train: --cache-dtype auto: reusing the complete {found} feature "
              f"cache", file=sys.stderr)


def resolve_precision(args, target) -> None:
    """Replace `--autocast auto` / `--cache-dtype auto` on `args` by what
    `target.precision.choose_autocast` measures for `target` on its device (bfloat16 or off /
    float32), said on stderr and kept as args.precision_rule_ms (training.json records args)."""
    wanted = [o for o in ("autocast", "cache_dtype") if getattr(args, o, None) == "auto"]
    if not wanted:
        return
    dtype, ms = choose_autocast(target)
    if "autocast" in wanted:
        args.autocast = "bfloat16" if dtype is not None else "off"
    if "cache_dtype" in wanted:
        args.cache_dtype = "bfloat16" if dtype is not None else "float32"
    args.precision_rule_ms = ms
    print(f"sharpdraft train: auto precision chose {'bfloat16 autocast' if dtype else 'float32'} "
          f"(largest linear at 512 rows, ms: {ms})", file=sys.stderr)


def load_data(args, target, tokenizer, provenance, layer_ids: List[int]):
    """(train, held-out) caches of the layers `layer_ids` (see `cache.cached_features`).

    Every recipe of the default target reads `drafters.common.evenly_spaced_layers(L, 4)` (or a
    subset), so one set of target forwards serves every drafter."""
    if args.seq_len < 16:
        raise SystemExit(f"--seq-len must be >= 16, got {args.seq_len}")
    kw = dict(seq_len=args.seq_len, topk=args.topk, seed=args.seed, corpus=args.corpus,
              online=getattr(args, "online_features", False))
    try:
        train = cached_features(target, tokenizer, provenance, layer_ids, split="train",
                                tokens=args.tokens, **kw,
                                autocast=autocast_dtype(getattr(args, "cache_dtype", "float32")))
        held = cached_features(target, tokenizer, provenance, layer_ids, split="heldout",
                               tokens=args.eval_tokens,
                               **{**kw, "corpus": getattr(args, "eval_corpus", None)
                                  or args.corpus})
    except FileNotFoundError as err:
        raise SystemExit(f"sharpdraft train: error: --corpus: {err}")
    return train, held


def autocast_dtype(name: str) -> Optional[torch.dtype]:
    """The autocast dtype of a --autocast or --cache-dtype value (None: "off" or "float32").

    Raises:
        ValueError: "auto", which `resolve_precision` replaces by a measured choice first."""
    if name == "auto":
        raise ValueError("autocast 'auto' must be resolved by training.loop.resolve_precision "
                         "before use")
    return None if name in ("off", "float32") else getattr(torch, name)


def lr_at(step: int, steps: int, lr: float, warmup: int, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 0 over the steps or the time budget, whichever
    runs out first (time_frac = elapsed / max_seconds)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = max((step - warmup) / max(1, steps - warmup), time_frac)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def save_atomically(model: nn.Module, out: Path, extra: dict) -> None:
    """Write `model.save(folder)` and training.json to a temporary sibling folder, then swap
    it in for `out` (the JSONL log already in `out` is kept)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save(tmp)
    (tmp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def fit(drafter: nn.Module, target, loss_fn: Callable, eval_fn: Callable, *, steps: int,
        lr: float, warmup: int, eval_every: int, out: Optional[Path], save_dtype: torch.dtype,
        max_seconds: Optional[float], seed: int = 0, weight_decay: float = 0.01,
        grad_clip: float = 1.0, meta: Optional[dict] = None, desc: str = "training",
        snapshot: Optional[Callable[[], nn.Module]] = None, progress: bool = True,
        eval_at_start: bool = False, autocast: Optional[torch.dtype] = None) -> dict:
    """Train `drafter` in place.

    loss_fn(gen, frac) -> (loss tensor, dict of extra log fields): one step's loss on a batch
    drawn with the torch.Generator `gen`; frac in [0, 1] is the run's progress (steps or time,
    whichever is further; curricula read it). eval_fn() -> dict with at least "loss",
    "tau_proxy" and "top1_per_position": the held-out evaluation; the checkpoint with the best
    tau_proxy is written to `out` (`snapshot()`, default a copy of the drafter, saved in
    `save_dtype`, plus training.json) through `save_atomically`. eval_at_start: evaluate
    (and save) before the first step too (a continued checkpoint's starting point).
    autocast: run loss_fn under `torch.autocast` in this dtype (mixed precision: the
    parameters, gradients and optimiser state stay in their own dtype; eval_fn is not
    autocast).

    Runs where the drafter's parameters are; draws come from a torch.Generator on the default
    device (`torch.device(...)` as a context manager sets it, as `sharpdraft train --device`
    does), so that the recipes' index tensors are made where their data is.

    Returns {"history", "evals", "best", "steps_done", "seconds"}.
    """
    for p in target.parameters():
        p.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    device_type = params[0].device.type
    history, evals, best = [], [], None
    t0 = time.time()
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    log = open(Path(out) / "train_log.jsonl", "a") if out is not None else None

    def copy() -> nn.Module:
        snap = type(drafter)(drafter.config)
        snap.load_state_dict(drafter.state_dict())
        return snap

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
        if progress:
            walk = f" walk {ev['tau_walk']:.3f}" if "tau_walk" in ev else ""
            tqdm.write(f"eval step {step}: loss {ev['loss']:.3f} tau~{ev['tau_proxy']:.3f}{walk} "
                       f"top1 {' '.join(f'{x:.2f}' for x in ev['top1_per_position'])}",
                       file=sys.stderr)
        if best is None or ev["tau_proxy"] > best["tau_proxy"]:
            best = ev
            if out is not None:
                with torch.no_grad():
                    model = (snapshot or copy)().to("cpu", save_dtype)
                save_atomically(model, out, {**(meta or {}), "best_eval": ev, "evals": evals})

    drafter.train()
    bar = tqdm(range(steps), desc=desc, unit="step", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    step = 0
    for step in bar:
        if (step and step % eval_every == 0) or (step == 0 and eval_at_start):
            do_eval(step)
        time_frac = (time.time() - t0) / max_seconds if max_seconds else 0.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup, time_frac)
        with autocast_to(device_type, autocast):
            loss, extra = loss_fn(gen, min(1.0, max(step / steps, time_frac)))
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
            if progress:
                tqdm.write(f"time budget reached after {step + 1} steps", file=sys.stderr)
            break
    bar.close()
    do_eval(step + 1)
    if log:
        log.close()
    return {"history": history, "evals": evals, "best": best, "steps_done": step + 1,
            "seconds": time.time() - t0}


def run_meta(args, provenance, drafter, init_layers, train, held) -> dict:
    """What training.json records of a run besides its results."""
    return {"command": "sharpdraft " + " ".join(sys.argv[1:]) if sys.argv else None,
            "args": vars(args), "target": provenance,
            "drafter_params": sum(p.numel() for p in drafter.parameters()),
            "init_from_target_layers": init_layers,
            "train_data": {k: v for k, v in train["meta"].items() if k != "target"},
            "heldout_data": {k: v for k, v in held["meta"].items() if k != "target"}}


def finish(out: Path, meta: dict, result: dict) -> dict:
    """Write training.json (meta, steps, time, tokens seen, best and all evaluations) and the
    model card README.md made from it (`card`), and print a summary; returns it."""
    hist = result["history"]
    summary = {**meta, "steps_done": result["steps_done"],
               "train_seconds": round(result["seconds"], 1),
               "trained_rows_seen": int(sum(h.get("rows", 0) for h in hist)),
               "final_train_loss_avg50": (sum(h["loss"] for h in hist[-50:])
                                          / max(1, len(hist[-50:]))),
               "best_eval": result["best"], "evals": result["evals"]}
    tmp = Path(out) / "training.json.partial"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, Path(out) / "training.json")
    card.write(out)
    print(json.dumps({k: summary[k] for k in ("steps_done", "train_seconds", "trained_rows_seen",
                                              "best_eval")}, indent=2))
    return summary


# ----- one recipe, one main --------------------------------------------------------------------
@dataclass
class Plan:
    """What a recipe hands `run_recipe` once its drafter exists: loss_fn(gen, frac) -> (loss,
    log fields) and eval_fn() -> held-out metrics, as `fit` takes them; snapshot() -> the module
    to save as the best checkpoint (None: a copy of the drafter); note: appended to the
    parameter count said on stderr."""

    loss_fn: Callable
    eval_fn: Callable[[], dict]
    snapshot: Optional[Callable[[], nn.Module]] = None
    note: str = ""


@dataclass(frozen=True)
class Recipe:
    """A drafter kind's training recipe, run by `run_recipe` (`sharpdraft train <name>`).

    name: the kind (registry name). drafter_cls: its Drafter class (`--init-from` loads it).
    arguments(parser): adds every flag of the recipe (`add_common_arguments` included).
    build(args, target, tokenizer, train) -> (untrained drafter, target layers it was
    initialised from or None); `train` is the train cache ({"features", "meta", "folder"}).
    plan(args, drafter, target, train, held, continued) -> Plan; continued: the drafter came
    from `--init-from` (its scales are part of the checkpoint).
    layers_option: None (the default): cache `evenly_spaced_layers(L, 4)`, shared by every
    drafter of the default target; else the option (args attribute) giving n for a drafter
    that reads exactly `evenly_spaced_layers(L, n)` (a continued checkpoint: its own layers).
    check(args): refuses bad flag combinations (SystemExit) before any work.
    eval_at_start: always evaluate before the first step (otherwise only a continued run).
    context_option: the option (args attribute) whose value the drafter records as
    config.train_context, its n_ref default: a continued run (`--init-from`) records its own,
    since the drafter's attention then adapts to that many keys.

    Hooks the evaluations read instead of switching on drafter kinds:
    anchor_leads(drafter, target, seq, anchors) -> (A,) int64 leading drafts equal to the
    target's top-1, teacher forced (`eval.sweep`); walk_evaluate(drafter, target, seqs, window)
    -> held-out metrics with "tau_walk" and "tau_proxy" over the last `window` rows of
    sequences whose features are the drafter's own layers (None where the recipe has no walk
    metric; `benchmarks/decoding_walk_cpu.py`).
    """

    name: str
    drafter_cls: type
    arguments: Callable[[argparse.ArgumentParser], None]
    build: Callable[..., tuple]
    plan: Callable[..., Plan]
    layers_option: Optional[str] = None
    check: Optional[Callable[[argparse.Namespace], None]] = None
    eval_at_start: bool = False
    anchor_leads: Optional[Callable[..., torch.Tensor]] = None
    walk_evaluate: Optional[Callable[..., dict]] = None
    context_option: str = "seq_len"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """The recipe's flags on `p` (the registry's recipe contract)."""
        self.arguments(p)

    def main(self, args: argparse.Namespace) -> dict:
        """`run_recipe(self, args)` (the registry's recipe contract)."""
        return run_recipe(self, args)

    def layers(self, args, target) -> List[int]:
        """The target layers whose outputs the run caches (see `layers_option`)."""
        if self.layers_option is None:
            return evenly_spaced_layers(target.config.num_hidden_layers, 4)
        if args.init_from:
            return self.drafter_cls.read_config(args.init_from).target_layer_ids
        return evenly_spaced_layers(target.config.num_hidden_layers,
                                    getattr(args, self.layers_option))


def with_draft_vocab(drafter, target, features):
    """`drafter` with its draft vocabulary set to the most frequent target ids of `features`
    where its config asks for one (config.draft_vocab_size not None); returns it."""
    size = drafter.config.draft_vocab_size
    if size is not None:
        vocab = target.get_output_embeddings().weight.shape[0]
        drafter.set_draft_vocab(draft_vocabulary(features, size, vocab))
    return drafter


def run_recipe(recipe: Recipe, args: argparse.Namespace) -> dict:
    """Train a drafter by `recipe` from parsed `args`: the target and the feature caches
    (`prepare_run`), the drafter (`--init-from`'s checkpoint or `recipe.build`), then `fit`
    writing config.json, model.safetensors and training.json (the best checkpoint) and
    train_log.jsonl to --out. Returns the training.json summary, or {"train_cache",
    "heldout_cache"} folders with --cache-only.

    Raises:
        SystemExit: bad options (recipe.check, --device, --seq-len, --corpus).
    """
    if recipe.check is not None:
        recipe.check(args)
    args.lr = args.lr * getattr(args, "lr_scale", 1.0)       # the peak learning rate used
    target, tokenizer, provenance, train, held, cache_s = prepare_run(
        args, lambda t: recipe.layers(args, t))
    if args.cache_only:
        return {"train_cache": train["folder"], "heldout_cache": held["folder"]}
    init = None
    if args.init_from:
        drafter, init = init_from_checkpoint(recipe.drafter_cls, args.init_from, target)
        init["train_context"] = drafter.config.train_context
        drafter.config.train_context = int(getattr(args, recipe.context_option))
        init_layers = None
    else:
        drafter, init_layers = recipe.build(args, target, tokenizer, train)
    plan = recipe.plan(args, drafter, target, train, held, init is not None)
    out = Path(args.out)
    meta = {"drafter": recipe.name,
            **run_meta(args, provenance, drafter, init_layers, train, held),
            "init_from": init, "cache_seconds": round(cache_s, 1)}
    print(f"sharpdraft train {recipe.name}: {meta['drafter_params'] / 1e6:.2f}M parameters"
          f"{plan.note}", file=sys.stderr)
    result = fit(drafter, target, plan.loss_fn, plan.eval_fn, steps=args.steps, lr=args.lr,
                 warmup=args.warmup, eval_every=args.eval_every, out=out,
                 save_dtype=getattr(torch, args.save_dtype),
                 max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                 seed=args.seed, meta=meta, eval_at_start=recipe.eval_at_start or init is not None,
                 desc=f"training {recipe.name}", autocast=autocast_dtype(args.autocast),
                 snapshot=plan.snapshot)
    return finish(out, meta, result)
