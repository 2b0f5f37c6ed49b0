"""EAGLE-3 tree shape against acceptance and speed: how many draft nodes the target should verify
per step on this CPU.

A tree drafter expands the `topk` best nodes at each of `depth` levels and the target verifies
the `tokens` best of them (by path probability) in one forward. More nodes raise the
acceptance length tau but make the verification forward wider. For every prompt this runs
target-only decoding once, then chain drafting and every --shapes tree in turn (greedy, the
same drafter, SharpDraft as `sharpdraft generate` sets it), and reports tau, the decode speedup
against that prompt's target-only run, and the draft and verify milliseconds per step.

Prompts: --corpus-prompts first-turn prompts of the corpus's held-out split (never trained on),
as `sharpdraft bench` picks them; --kjv-context adds the main job's Genesis prompt.
Writes tree_shape.json, tree_shape.md and tree_shape.png to --out.

    python benchmarks/tree_shape_cpu.py --corpus corpus --corpus-prompts 8 \\
        --kjv-context 2048 --out benchmarks/results/tree-shape-panel-cpu
"""
import argparse
import dataclasses
import statistics

import torch
from tqdm import tqdm

import sharpdraft
from sharpdraft.eval.bench import KJV_TASK, corpus_prompts, decode, kjv_passage, warm_up
from sharpdraft.eval.report import figure, write_report
from sharpdraft.inference import autoregressive_generate, prompt_ids


def parse_shape(text: str) -> dict:
    """"TOPKxDEPTHxTOKENS" -> the drafter config fields (argparse type)."""
    try:
        topk, depth, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree shape is TOPKxDEPTHxTOKENS, e.g. 8x6x32, "
                                         f"got {text!r}") from None
    if min(topk, depth, tokens) < 1:
        raise argparse.ArgumentTypeError(f"tree shape {text}: every part must be >= 1")
    return {"tree_topk": topk, "tree_depth": depth, "tree_tokens": tokens}


def label(shape: dict) -> str:
    return f"tree {shape['tree_topk']}x{shape['tree_depth']}x{shape['tree_tokens']}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=parse_shape, nargs="+",
                   default=[parse_shape(s) for s in
                            ("4x5x16", "6x6x24", "8x6x32", "10x6x48", "10x7x64")])
    p.add_argument("--corpus", default="corpus")
    p.add_argument("--corpus-prompts", type=int, default=8)
    p.add_argument("--kjv-context", type=int, default=None,
                   help="also decode the main job's prompt: N Genesis tokens + the summary task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafter-path", default=None, help="default: the shipped EAGLE-3")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/tree-shape-cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # the same target, drafter and SharpDraft settings as `sharpdraft generate`; one drafter
    # per tree shape (the shape is part of its config)
    target, tokenizer, provenance = sharpdraft.load_target(dtype=args.dtype)
    source = args.drafter_path or "eagle3"
    drafter = sharpdraft.load_drafter(source, target, kind="eagle3")
    prompts = corpus_prompts(args.corpus, args.corpus_prompts)
    if args.kjv_context:
        ids = prompt_ids(tokenizer, KJV_TASK, kjv_passage(tokenizer, args.kjv_context,
                                                               "--kjv-context"), True)
        prompts.append({"name": f"genesis-{args.kjv_context}", "ids": ids})
    methods = {"chain": (drafter, False)}
    methods.update({label(s): (sharpdraft.load_drafter(source, target, kind="eagle3",
                                                       overrides=s), True) for s in args.shapes})
    for d, tree in methods.values():
        warm_up(target, d, prompts[0]["ids"], tree=tree)
    eos = tokenizer.eos_token_id
    rows = []
    for pr in tqdm(prompts, desc="prompts", unit="prompt"):
        ar = autoregressive_generate(target, pr["ids"], args.max_new_tokens, eos_token_id=eos)
        row = {"name": pr["name"], "prompt_tokens": pr["ids"].shape[1], "ar": ar.summary()}
        for name, (d, tree) in methods.items():
            res = decode(target, d, pr["ids"], args.max_new_tokens, tree=tree, eos_token_id=eos)
            row[name] = {**res.summary(), "identical_to_ar": res.tokens == ar.tokens,
                         "decode_speedup": res.decode_tokens_per_s / ar.decode_tokens_per_s}
        rows.append(row)

    held = [r for r in rows if not r["name"].startswith("genesis-")]
    summary = {}
    for name in methods:
        sel = held or rows
        summary[name] = {
            "mean_tau": statistics.fmean(r[name]["tau"] for r in sel),
            "geomean_decode_speedup": statistics.geometric_mean(
                r[name]["decode_speedup"] for r in sel),
            "median_draft_ms": statistics.median(r[name]["draft_ms_per_step"] for r in sel),
            "median_verify_ms": statistics.median(r[name]["verify_ms_per_step"] for r in sel),
            "lossless": all(r[name]["identical_to_ar"] for r in rows)}
    meta = {"max_new_tokens": args.max_new_tokens, "threads": args.threads,
            "target": provenance, "drafter_path": args.drafter_path or "shipped eagle3-smollm2",
            "chain_length": drafter.max_drafts, "sharp": {k: (None if v == float("inf") else v)
                      for k, v in drafter.sharp.kernel_kwargs().items()},
            "held_out_prompts": len(held)}
    lines = [f"EAGLE-3 on {len(held)} held-out corpus prompts, greedy, {args.max_new_tokens} new "
             f"tokens, {args.threads} threads, {provenance['dtype']}; tree shape = top-k x depth"
             f" x nodes verified. Decode speedup: geometric mean against each prompt's "
             f"target-only run in the same process.", "",
             "| drafting | mean tau | decode speedup | draft ms / step | verify ms / step | "
             "lossless |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {k} | {v['mean_tau']:.3f} | {v['geomean_decode_speedup']:.3f}x | "
              f"{v['median_draft_ms']:.1f} | {v['median_verify_ms']:.1f} | {v['lossless']} |"
              for k, v in summary.items()]
    lines += ["", "| prompt | tokens | AR decode tok/s | "
              + " | ".join(f"{k}: tau, decode x" for k in methods) + " |",
              "|---|---:|---:|" + "---:|" * len(methods)]
    lines += [f"| {r['name']} | {r['prompt_tokens']} | {r['ar']['decode_tokens_per_s']:.1f} | "
              + " | ".join(f"{r[k]['tau']:.2f}, {r[k]['decode_speedup']:.2f}x" for k in methods)
              + " |" for r in rows]

    fig, (a1, a2) = figure(1, 2, figsize=(9, 3.6))
    xs = [1 + (d.max_tree_nodes if t else d.max_drafts) for d, t in methods.values()]
    for ax, key, ylab in ((a1, "mean_tau", "mean tau"),
                          (a2, "geomean_decode_speedup", "decode speedup (x)")):
        ax.plot(xs[1:], [summary[k][key] for k in list(methods)[1:]], "o-", label="tree")
        ax.plot(xs[:1], [summary["chain"][key]], "s", label="chain")
        ax.set_xlabel("rows verified per step")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
    a2.axhline(1.0, color="grey", lw=0.8)
    a1.legend()
    fig.suptitle(f"EAGLE-3 tree size on {len(held)} held-out prompts (CPU)")
    write_report(args.out, "tree_shape",
                 {"meta": meta,
                  "shapes": {k: dataclasses.asdict(d.config) for k, (d, _) in methods.items()},
                  "summary": summary, "rows": rows}, lines, default=str, figure=fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
