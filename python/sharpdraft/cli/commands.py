"""`sharpdraft` command line: speculative generation on a real target model.

    sharpdraft generate --prompt "Explain speculative decoding." --compare-ar
    sharpdraft generate --kjv-context 2048 --compare-ar      # Genesis + "Summarise the passage ..."
    sharpdraft generate --prompt-file task.txt --context-file passage.txt --sharp --slope 0.2 --json
    sharpdraft bench --out bench-results --lengths 1024 2048 4096 6144 --maths 4

    sharpdraft generate --drafter eagle3 --tree --kjv-context 2048 --compare-ar
    sharpdraft bench --drafter pard --out bench-pard --lengths 1024 2048 --maths 1

Without --drafter-path the default target (SmolLM2-135M-Instruct) drafts with the shipped trained
checkpoint of --drafter (dflash, eagle3, pard or longspark:
sharpdraft/checkpoints/<drafter>-smollm2, from `sharpdraft train <drafter>`); other targets get an
untrained drafter (seeded: lossless, tau about 1), as does --drafter-path untrained.

    sharpdraft train dflash --out my-drafter --tokens 131072 --steps 1000 --threads 2
    sharpdraft train eagle3 --corpus corpus --out my-eagle --max-minutes 12 --threads 2

    sharpdraft data generate --out corpus --tokens 1000000 --batch 16 --threads 2   # resumable

    sharpdraft analyze mass --drafter dflash --out analysis/mass      # dilution by context
    sharpdraft analyze calibrate --drafter dflash --no-write          # per-layer slopes
    sharpdraft analyze sweep --drafter dflash --out analysis/sweep    # proxy tau per scaling
    sharpdraft analyze sweep --drafter dflash --decode 1024 --out analysis/decode   # by output length
    sharpdraft analyze compare runs/a/sweep runs/b/sweep --out analysis/compare   # checkpoints, paired
    sharpdraft analyze adapt --drafter dflash --out analysis/adapt    # vs online fine-tuning

This module holds the command bodies, which call the library (load_target, load_drafter,
generate, sharpdraft.eval, sharpdraft.training, sharpdraft.data), and `main`, which turns every
run-time error into one line; `parser` defines the flags and validates them once.
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

from ..data.sources import KJV_TASK, kjv_passage
from ..drafters import load_drafter, registry, shipped_checkpoint
from ..drafters.loading import N_REF_SOURCES
from ..inference import generate, prompt_ids
from ..inference.engine import GenerationResult, check_context, seq_rep
from ..inference.policy import resolve as resolve_policy
from ..target.loading import load_target
from .parser import DTYPES, drafter_kind, leaf, parse, parser

__all__ = ["DTYPES", "build_drafter", "check_context", "cmd_analyze", "cmd_bench", "cmd_data",
           "cmd_generate", "cmd_train", "default_drafter_path", "describe_error", "load_target_for",
           "main", "parse", "parser", "print_report"]

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
    stderr), --slope, --n-ref, --context-window, --attention-sinks, --tree-* and --sharp /
    --frozen.

    Raises:
        FileNotFoundError / ValueError naming the checkpoint folder and the file or field
            (`load_drafter`: checked before any weight is read).
    """
    args.drafter = drafter_kind(args.drafter, args.drafter_path)   # when parse was bypassed
    path = default_drafter_path(args)
    shape = {f: getattr(args, f) for f in registry.get(args.drafter).cls.tree_options
             if getattr(args, f, None) is not None}
    options = dict(target=target, tokenizer=tokenizer, sharp=getattr(args, "sharp", True),
                   slope=args.slope, n_ref=args.n_ref, overrides=shape or None,
                   context_window=getattr(args, "context_window", None),
                   attention_sinks=getattr(args, "attention_sinks", 0))
    if path is None:
        print(f"sharpdraft: no trained drafter: using an untrained {args.drafter} drafter "
              f"(tau ~ 1)", file=sys.stderr)
        return load_drafter(args.drafter, untrained=True, layers=args.drafter_layers,
                            block_size=args.block_size, seed=args.seed, **options)
    return load_drafter(path, kind=args.drafter, **options)


def load_target_for(args):
    """`load_target` with --target and --dtype (`auto` measures float32 against bfloat16 on this
    CPU and says what it chose on stderr). Returns (target, tokenizer, provenance) with
    provenance["dtype"] (and, for auto, the measurement).

    Raises:
        ValueError naming --target: a target that cannot be loaded (a corrupt .gguf file, a
            folder whose config or weights transformers cannot read), with the reason.
    """
    try:
        target, tokenizer, provenance = load_target(args.target, dtype=args.dtype,
                                                    weights=getattr(args, "weights", "dense"))
    except Exception as err:          # whatever the loaders raise: name the flag and the file
        if isinstance(err, (ImportError, MemoryError)) or args.target is None:
            raise
        raise ValueError(f"--target {args.target}: cannot load it ({describe_error(err)})"
                         ) from err
    if getattr(args, "weights", None) == "auto" and "weights_rule_ms" in provenance:
        print(f"sharpdraft: --weights auto chose {provenance['weights']} (largest linear at "
              f"1 / 8 rows, ms: {provenance['weights_rule_ms']})", file=sys.stderr)
    if args.dtype == "auto" and "dtype_rule_ms" in provenance:
        print(f"sharpdraft: --dtype auto chose {provenance['dtype']} (largest linear at 1 / 8 "
              f"rows, ms: {provenance['dtype_rule_ms']})", file=sys.stderr)
    return target, tokenizer, provenance


def _run(label: str, fn, total: int) -> GenerationResult:
    from tqdm import tqdm

    with tqdm(total=total, desc=label, unit="tok", file=sys.stderr, leave=False) as bar:
        return fn(progress=bar.update)


def _check_prompts(target, prompts, max_new_tokens: int, flag: str = "--max-new-tokens"):
    for p in prompts:
        check_context(target, p["ids"].shape[1], max_new_tokens, what=f"prompt {p['name']}",
                      flag=flag)


def cmd_generate(args) -> dict:
    """`sharpdraft generate`: one prompt (--prompt, --prompt-file or the bench's KJV task; after
    --context-file or --kjv-context; or --task, a task of the held-out suite as the bench
    renders it) through `sharpdraft.generate`, with --compare-ar the target alone too.
    Returns the report --json prints."""
    target, tokenizer, provenance = load_target_for(args)
    if args.task is not None:         # the suite's own ids (validate checked the name)
        from ..data.tasks import SUITE
        from ..eval.bench import suite_prompts

        kind = next(c for c in SUITE if args.task.startswith(c + "-"))
        ids = next(p["ids"] for p in suite_prompts(tokenizer, [kind]) if p["name"] == args.task)
    else:
        prompt = args.prompt_text if args.prompt_text is not None else KJV_TASK
        if args.kjv_context is not None:
            context = kjv_passage(tokenizer, args.kjv_context, "--kjv-context")
        else:
            context = args.context_text
        ids = prompt_ids(tokenizer, prompt, context, not args.no_chat_template)
    check_context(target, ids.shape[1], args.max_new_tokens, flag="--max-new-tokens")
    drafter = build_drafter(target, tokenizer, args)
    common = dict(temperature=args.temperature, eos_token_id=tokenizer.eos_token_id,
                  seed=args.seed)
    if args.compare_ar:         # one-time costs (allocator, op dispatch) out of the timed runs
        generate(target, None, ids[:, :64], max_new_tokens=2)
        generate(target, drafter, ids[:, :64], max_new_tokens=2, tree=args.tree,
                 draft_threshold=args.draft_threshold, policy=args.draft_policy)
    spec = _run("speculative", lambda progress: generate(
        target, drafter, ids, max_new_tokens=args.max_new_tokens, tree=args.tree,
        draft_threshold=args.draft_threshold, policy=args.draft_policy, progress=progress,
        **common), args.max_new_tokens)
    report = {"text": tokenizer.decode(spec.tokens, skip_special_tokens=True), **spec.summary(),
              "seq_rep_4": seq_rep(spec.tokens), "task": args.task,
              "drafter": args.drafter + ("-tree" if args.tree else ""),
              "draft_threshold": 0.0 if args.tree or spec.policy.get("policy") == "auto" else (
                  drafter.default_draft_threshold if args.draft_threshold is None
                  else args.draft_threshold),
              "sharp": {k: (None if v == math.inf else v)         # strict JSON: no Infinity
                        for k, v in drafter.sharp.kernel_kwargs().items()},
              "max_drafts": drafter.max_tree_nodes if args.tree else drafter.max_drafts,
              "tree_shape": drafter.tree_shape() if args.tree else None,
              "n_ref_source": getattr(drafter, "n_ref_source", None),
              "context_window": drafter.context_window,
              "attention_sinks": drafter.attention_sinks,
              "fused_draft_step": drafter.fused_step,
              "target": provenance}
    if args.compare_ar:
        ar = _run("target-only", lambda progress: generate(
            target, None, ids, max_new_tokens=args.max_new_tokens, progress=progress,
            **common), args.max_new_tokens)
        decode_speedup = spec.decode_tokens_per_s / ar.decode_tokens_per_s
        report.update(ar_tokens_per_s=ar.tokens_per_s, ar_new_tokens=ar.new_tokens,
                      ar_decode_tokens_per_s=ar.summary()["decode_tokens_per_s"],
                      ar_prefill_s=ar.prefill_s,
                      speedup=spec.tokens_per_s / ar.tokens_per_s,
                      decode_speedup=decode_speedup if math.isfinite(decode_speedup) else None,
                      identical_to_ar=ar.tokens == spec.tokens if args.temperature == 0 else None)
    return report


def _bench_prompts(target, tokenizer, args, maths: int) -> list:
    """The bench's prompts: Genesis passages of --lengths, `maths` champ problems and
    --corpus-prompts held-out corpus prompts, each checked against the target's context.

    Raises:
        ValueError naming the flag: an unreadable --corpus, no prompt at all, or a prompt that
            leaves no room for --max-new-tokens.
    """
    from ..eval.bench import build_prompts, corpus_prompts, suite_prompts

    if getattr(args, "suite", None) == "tasks":
        from ..data.tasks import SUITE
        try:
            prompts = suite_prompts(tokenizer, args.categories or SUITE)
        except ValueError as err:
            raise ValueError(f"--categories: {describe_error(err)}") from err
    else:
        prompts = build_prompts(tokenizer, args.lengths, maths)
    if args.corpus_prompts:
        try:
            prompts += corpus_prompts(args.corpus, args.corpus_prompts)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"--corpus {args.corpus}: {describe_error(err)}") from err
    if not prompts:
        raise ValueError("no prompts (--lengths" + (", --maths" if maths else "")
                         + " and --corpus-prompts are all empty)")
    _check_prompts(target, prompts, args.max_new_tokens)
    return prompts


def _bench_policies(args) -> tuple:
    """The draft policies a bench runs: --draft-policy's, else both (fixed with
    --draft-threshold)."""
    if args.draft_policy:
        resolve_policy(args.draft_policy, args.draft_threshold)
        return (args.draft_policy,)
    return ("fixed",) if args.draft_threshold else ("fixed", "auto")


def cmd_bench(args) -> dict:
    """`sharpdraft bench`: sharpdraft.eval.bench.run_bench over KJV passages (--lengths), maths
    problems (--maths) or the held-out task suite (--suite tasks), and held-out corpus prompts
    (--corpus-prompts)."""
    from ..eval.bench import bench_variants, run_bench

    target, tokenizer, provenance = load_target_for(args)
    if args.suite == "sessions":
        return _bench_sessions(target, tokenizer, provenance, args)
    prompts = _bench_prompts(target, tokenizer, args, args.maths)
    drafter = build_drafter(target, tokenizer, args)
    variants = bench_variants(args.drafter, drafter, registry.get(args.drafter).trees)
    rows = run_bench(target, tokenizer, variants, prompts, args.max_new_tokens, args.slope,
                     Path(args.out), draft_threshold=args.draft_threshold,
                     target_info=provenance, policies=_bench_policies(args))
    print((Path(args.out) / "bench.md").read_text())
    print(f"wrote {args.out}/bench.json, bench.md, tau_vs_context.png, speedup_by_kind.png")
    return {"target": provenance, "runs": len(rows)}


def _bench_sessions(target, tokenizer, provenance, args) -> dict:
    """`sharpdraft bench --suite sessions`: the drafter frozen over every key (real, timed),
    with SharpDraft (replayed) and frozen in --context-window W (default: the drafter's measured
    window, if it has one; replayed)."""
    from ..data.sessions import SESSIONS, sessions
    from ..eval.sessions import Variant, run

    chosen = sessions(tokenizer, args.sessions or SESSIONS)     # names checked by the parser
    kind = drafter_kind(args.drafter, args.drafter_path)

    def drafter(sharp: bool, window):
        return build_drafter(target, tokenizer, argparse.Namespace(
            **{**vars(args), "drafter": kind, "sharp": sharp, "context_window": window,
               "attention_sinks": args.attention_sinks if window else 0}))
    frozen = drafter(False, 0)
    sharp = drafter(True, 0)
    slope = "calibrated" if sharp.sharp.layer_slopes else f"slope {sharp.sharp.slope:g}"
    variants = [Variant(f"{kind} frozen", frozen, kind, real=True, n_ref=frozen.sharp.n_ref),
                Variant(f"{kind} {slope}", sharp, kind, n_ref=sharp.sharp.n_ref)]
    window = (frozen.default_context_window if args.context_window is None
              else args.context_window)
    if window:
        w = drafter(False, window)
        sinks = f"+{args.attention_sinks}" if args.attention_sinks else ""
        variants.append(Variant(f"{kind} window {window}{sinks}", w, kind, n_ref=w.sharp.n_ref))
    data = run(target, tokenizer, chosen, variants, out=Path(args.out),
               max_new_tokens=args.max_new_tokens, target_name=provenance.get("source", ""))
    print((Path(args.out) / "sessions.md").read_text())
    print(f"wrote {args.out}/sessions.json, sessions.md, sessions.png")
    return {"target": provenance, "rows": len(data["rows"])}


def cmd_analyze(args) -> dict:
    """`sharpdraft analyze mass|calibrate|sweep|compare|adapt`: the frozen drafter's attention
    probed while decoding held-out KJV passages (sharpdraft.eval.mass.run / calibrate.run), the
    acceptance sweep, its comparison across checkpoints, online adaptation."""
    if args.analysis == "compare":                 # reads sweep reports only: no target
        return compare_command(args)
    target, tokenizer, provenance = load_target_for(args)
    drafter = build_drafter(target, tokenizer, args)
    if args.analysis in ("mass", "calibrate") and not drafter.one_softmax_per_call:
        raise ValueError(f"--drafter {args.drafter}: its softmax spans several kernel calls "
                         f"(merged by log-sum-exp), which the attention probe cannot read as one "
                         f"row distribution; `analyze sweep` works for it")
    if args.analysis == "calibrate":
        from ..eval import calibrate

        folder = None if args.no_write else default_drafter_path(args)
        if folder is None and not args.no_write:
            raise ValueError("an untrained drafter has no checkpoint to write into: pass "
                             "--drafter-path or --no-write")
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
    from ..eval import mass

    for n in args.lengths:
        check_context(target, n + 64, args.steps, what=f"--lengths {n} passage (+ 64)",
                      flag="--steps")
    rows = mass.run(target, tokenizer, drafter, drafter_name=args.drafter, lengths=args.lengths,
                    steps=args.steps, out=args.out, topk=args.topk, rows=args.rows,
                    seed=args.seed, include_target=not args.no_target)
    print((Path(args.out) / "mass.md").read_text())
    return {"target": provenance, "out": args.out, "rows": len(rows)}


def adapt_command(target, tokenizer, provenance, drafter, args) -> dict:
    """`sharpdraft analyze adapt`: eval.adapt.run on the bench's Genesis prompts (and held-out
    corpus prompts)."""
    from ..eval import adapt

    if not adapt.OnlineAdapter.supports(drafter):
        raise ValueError(f"--drafter {args.drafter}: online adaptation needs a drafter with "
                         f"teacher-forced blocks (DFlash)")
    prompts = _bench_prompts(target, tokenizer, args, 0)
    rep = adapt.run(target, tokenizer, drafter, prompts, max_new_tokens=args.max_new_tokens,
                    out=args.out, every=args.every, lr=args.lr, lora_ranks=args.lora_ranks,
                    slope=0.2 if args.slope is None else args.slope)
    print((Path(args.out) / "adapt.md").read_text())
    return {"target": provenance, "out": args.out, "summary": rep["summary"]}


def _sweep_report(folder: str) -> dict:
    """The sweep.json of `folder`, checked to be a sweep report.

    Raises:
        ValueError naming the file: not JSON (with the position), or no settings / rows."""
    path = Path(folder) / "sweep.json"
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({describe_error(err)})") from None
    if not (isinstance(rep, dict) and isinstance(rep.get("settings"), dict)
            and isinstance(rep.get("rows"), list)):
        raise ValueError(f"{path}: not a sweep report (it needs \"settings\" and \"rows\", as "
                         f"`sharpdraft analyze sweep` writes them)")
    for key in ("drafter", "text"):
        if key not in rep["settings"]:
            raise ValueError(f"{path}: not a sweep report (no settings.{key})")
    return rep


def compare_command(args) -> dict:
    """`sharpdraft analyze compare BASE OTHER...`: sweep reports of several checkpoints paired
    anchor by anchor against BASE's --base-scaling (eval.sweep.compare); writes compare.json,
    compare.md and compare.png to --out."""
    from ..eval import sweep

    reports = {folder: _sweep_report(folder) for folder in [args.base] + args.others}
    base = reports.pop(args.base)
    names = {Path(f).name: rep for f, rep in reports.items()}
    if len(names) != len(reports) or "base" in names:
        names = dict(reports)           # folder names collide (or with "base"): use the paths
    rows = sweep.compare(base, names, base_scaling=args.base_scaling, seed=args.seed)
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
    4 evenly spaced target layers every shipped drafter reads), then eval.sweep.run; with
    --decode, eval.long_decode.run (tau by output length in real decoding)."""
    from ..drafters.common import evenly_spaced_layers
    from ..eval import sweep
    from ..training.cache import cached_features

    if args.decode:                    # part (b): real decoding with long outputs
        from ..eval import long_decode
        prompts = long_decode.long_output_prompts(tokenizer)
        _check_prompts(target, prompts, args.decode, flag="--decode")
        rep = long_decode.run(target, tokenizer, drafter, prompts, drafter_name=args.drafter,
                              max_new_tokens=args.decode, bucket=args.bucket, out=args.out,
                              only=args.scalings, seed=args.seed)
        print((Path(args.out) / "decode.md").read_text())
        return {"target": provenance, "out": args.out, "rows": len(rep["rows"])}
    layer_ids = evenly_spaced_layers(target.config.num_hidden_layers, 4)
    check_context(target, args.length, 0, what="--length")
    try:
        data = cached_features(target, tokenizer, provenance, layer_ids, split="heldout",
                               tokens=(10 ** 9 if args.corpus else args.sequences * args.length),
                               seq_len=args.length, topk=32, seed=args.seed, corpus=args.corpus)
    except FileNotFoundError as err:
        raise ValueError(f"--corpus {args.corpus}: {describe_error(err)}") from err
    n = len(data["features"])
    text = (f"the {n} held-out conversations of {args.corpus} (target responses)" if args.corpus
            else f"{n} held-out text sequences of {args.length} tokens (sharpdraft.data "
                 f"held-out split; --sequences {args.sequences} asked for)")
    rep = sweep.run(target, drafter, data["features"], layer_ids, drafter_name=args.drafter,
                    edges=args.edges, per_bucket=args.per_bucket, out=args.out,
                    seed=args.seed, text=text, only=args.scalings)
    print((Path(args.out) / "sweep.md").read_text())
    return {"target": provenance, "out": args.out, "rows": len(rep["rows"])}


def cmd_data(args) -> dict:
    """`sharpdraft data generate`: load the target and prepare its runtime (the "auto" plan),
    then generate or resume the corpus in --out (sharpdraft.data.corpus.generate_corpus).
    Returns a summary: counts per split, the measured response tokens/s, the manifest's path."""
    from ..data import corpus
    from ..target.runtime import TargetRuntime
    from ..training.loop import training_device

    device = training_device(args.device)
    if args.weights == "auto":      # the GGUF's blocks where there are some (the fast path)
        gguf = args.target is None or str(args.target).endswith(".gguf")
        args.weights = "gguf" if gguf and device.type == "cpu" else "dense"
    if device.type == "cuda" and args.dtype == "float32":
        raise ValueError("--device cuda needs --dtype bfloat16 or float16 (the CUDA kernel's "
                         "dtypes)")
    target, tokenizer, provenance = load_target_for(args)
    runtime = TargetRuntime.prepare(target.to(device))
    settings = corpus.Settings(batch=args.batch, max_new_tokens=args.max_new_tokens,
                               seed=args.seed, batches_per_shard=args.batches_per_shard,
                               temperature=args.temperature, top_p=args.top_p,
                               heldout_every=args.heldout_every, max_seq_len=args.max_seq_len,
                               dtype=args.dtype, weights=args.weights)
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and args.max_seq_len > limit:
        raise ValueError(f"--max-seq-len {args.max_seq_len} exceeds the target's context of "
                         f"{limit} (max_position_embeddings)")
    manifest = corpus.generate_corpus(runtime, tokenizer, args.out, args.tokens, settings,
                                      provenance=provenance, sources=args.sources)
    return {"out": str(args.out), "manifest": str(Path(args.out) / corpus.MANIFEST),
            "shards": len(manifest["shards"]), "counts": manifest["counts"],
            "throughput": manifest["throughput"]}


def cmd_export(args) -> dict:
    """`sharpdraft export`: the drafter (--drafter-path, else the shipped checkpoint of
    --drafter) written in its public layout to --out, read back and checked
    (`drafters.export.export_drafter`). Returns the report printed as JSON."""
    from ..drafters.export import export_drafter

    target, tokenizer, provenance = load_target(args.target, dtype=torch.float32)
    path = args.drafter_path or shipped_checkpoint(args.drafter)
    if path is None:
        raise ValueError(f"--drafter {args.drafter}: ships no checkpoint for this target; pass "
                         f"--drafter-path")
    drafter = load_drafter(path, target, kind=args.drafter, sharp=False)
    report = export_drafter(drafter, target, args.out, tokenizer=tokenizer,
                            dtype=getattr(torch, args.dtype))
    return {"drafter": args.drafter, "from": str(path), **report,
            "target": provenance.get("source") or provenance.get("folder")}


def cmd_train(args) -> None:
    """`sharpdraft train <drafter>`: the drafter kind's training recipe (sharpdraft.training),
    with new tensors created on --device."""
    from .. import training
    from ..training.loop import training_device

    with torch.device(training_device(args.device)):   # new tensors where the data is
        training.recipe(args.drafter).main(args)


def print_report(report: dict) -> None:
    """The human-readable form of `cmd_generate`'s report (without --json)."""
    print(report["text"])
    task = f" (suite task {report['task']})" if report.get("task") else ""
    print(f"\n{report['new_tokens']} new tokens after a {report['prompt_tokens']}-token prompt"
          f"{task}; "
          f"{report['target_forwards']} target forwards; tau = {report['tau']:.3f}; "
          f"{report['tokens_per_s']:.1f} tok/s")
    est = report.get("policy_estimates") or {}
    if est.get("policy") == "auto":
        print(f"draft policy auto: {100 * (est['drafted_share'] or 0):.0f}% of steps drafted, "
              f"mean draft length {report['mean_draft_length']:.2f}; target step "
              f"{est['target_step_ms']} ms, +{est['verify_ms_per_row']} ms a verified row")
    elif est:
        print(f"draft policy fixed (draft threshold {report['draft_threshold']:g})")
    if "seq_rep_4" in report:
        print(f"seq-rep-4 {report['seq_rep_4']:.2f}: the share of the output's 4-grams that "
              f"repeat (near 0 for ordinary text, towards 1 in a loop, the easiest to draft)")
    if report.get("n_ref_source"):
        sharp = report["sharp"]
        state = (f"SharpDraft on (slope {sharp['slope']:g})" if sharp["mode"] != "none"
                 else "SharpDraft off (frozen drafter)")
        print(f"{state}; n_ref {sharp['n_ref']}: {N_REF_SOURCES[report['n_ref_source']]}")
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
                  "the one-row decode step, so near-tied tokens can differ (docs/architecture.md, "
                  "--dtype auto); --dtype float32 gives token-identical output")
        if report.get("decode_speedup") is not None:
            print(f"target-only AR decode: {report['ar_decode_tokens_per_s']:.1f} tok/s; "
                  f"decode speedup {report['decode_speedup']:.3f}x")


def _error_types() -> tuple:
    """Exceptions whose message is meant for the user as it stands (no type name shown)."""
    types = [ValueError, OSError, ImportError]
    try:
        from safetensors import SafetensorError
        types.append(SafetensorError)
    except ImportError:
        pass
    return tuple(types)


def describe_error(err: BaseException, limit: int = 600) -> str:
    """One line saying what went wrong: the message of an error meant for the user (ValueError,
    OSError with its file, ImportError, SafetensorError; a JSON error with its position), else
    "<type>: <message>"; whitespace collapsed, cut at `limit` characters."""
    if isinstance(err, json.JSONDecodeError):
        text = f"{err.msg} at line {err.lineno} column {err.colno}"
    elif isinstance(err, OSError) and err.filename is not None:
        text = f"{err.filename}: {err.strerror or err}"
        if err.filename2 is not None:
            text += f" ({err.filename2})"
    elif isinstance(err, KeyError):
        text = f"KeyError: missing key {err}"
    else:
        text = str(err).strip() or type(err).__name__
        if not isinstance(err, _error_types()):
            text = f"{type(err).__name__}: {text}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "analyze": cmd_analyze,
            "data": cmd_data, "train": cmd_train, "export": cmd_export}


def main(argv=None) -> int:
    """The `sharpdraft` command: parse and validate `argv` (default: sys.argv[1:]), run the
    command, print its result.

    Returns:
        0 on success; 1 after a run-time error, reported as one line
        `sharpdraft <command>: error: <message>` on stderr (with --debug: re-raised, with its
        traceback); 130 after Ctrl-C.

    Raises:
        SystemExit(2) after one error line on stderr: a bad flag, value, file or folder
            (`parser.validate`, before any model is loaded).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    top = parser()
    args = parse(argv, top)
    debug = args.debug
    del args.debug                      # not an option of the command (training.json records args)
    prog = leaf(top, args).prog
    try:
        if getattr(args, "threads", None) is not None:
            torch.set_num_threads(args.threads)
        report = COMMANDS[args.command](args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:           # a library's own exit with a message (training)
        if debug or not isinstance(err.code, str):
            raise
        message = err.code.strip()
        if message.startswith("sharpdraft") and ": error: " in message:
            message = message.split(": error: ", 1)[1]
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        return 1
    except Exception as err:
        if debug:
            raise
        hint = "" if isinstance(err, _error_types()) else " (--debug shows the traceback)"
        print(f"{prog}: error: {describe_error(err)}{hint}", file=sys.stderr)
        return 1
    if args.command in ("data", "analyze", "export"):
        print(json.dumps(report, indent=2))
    elif args.command == "generate":
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
