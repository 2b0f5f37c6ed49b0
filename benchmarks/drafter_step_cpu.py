"""What drafting costs on the default runtime, through the drafter's modules and through its
fused CPU step (issue 52): EAGLE-3 (the default drafter; --drafter pard / dflash for theirs) on
the default GGUF target.

For each --contexts length, the first n tokens of Genesis (held out from training) and the
bench's summary task are decoded greedily for --new-tokens tokens, chain (draft threshold 0, so
every step drafts its full chain or block) and, for a drafter that drafts trees, tree, with SHARPDRAFT_FUSED_DRAFTERS=0 (the
modules: the measured linear plan, the packed draft head) and =1 (`eagle3_layer`; with
--context-window W also fused over a W-key window, mode fused-wW), interleaved,
--repeats times; reported as medians: drafting ms per step and per drafted token (propose +
commit over the drafts proposed), the ratio of a drafted token to a target-only decode step
(timed in the same rounds), tau and decode tokens per second. The target is the same in both
modes, and so is every output (greedy, lossless).

    python benchmarks/drafter_step_cpu.py --out benchmarks/results/drafter-step-cpu
    python benchmarks/drafter_step_cpu.py --drafter pard --out benchmarks/results/drafter-step-cpu/pard
    python benchmarks/drafter_step_cpu.py --contexts 2048 6144 --context-window 512 \
        --out benchmarks/results/drafter-step-cpu/window
"""
import argparse
import os
import platform
import statistics

import torch
from tqdm import tqdm

import sharpdraft_ext as ext
from sharpdraft.drafters.loading import load_drafter
from sharpdraft.eval.bench import KJV_TASK, kjv_passage
from sharpdraft.eval.report import write_report
from sharpdraft.inference.engine import (autoregressive_generate, speculative_generate,
                                         tree_speculative_generate)
from sharpdraft.target.loading import load_target
from sharpdraft.target.runtime import TargetRuntime

MODES = {"modules": "0", "fused": "1"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", default="eagle3")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context-window", type=int, default=None,
                   help="also a fused mode with this drafter context window (mode fused-w<W>)")
    p.add_argument("--out", default="benchmarks/results/drafter-step-cpu")
    args = p.parse_args()
    modes = dict(MODES)
    if args.context_window:
        modes[f"fused-w{args.context_window}"] = "1"
    torch.set_num_threads(args.threads)
    model, tok, provenance = load_target(weights="gguf")
    runtime = TargetRuntime.prepare(model)
    drafter = load_drafter(args.drafter, runtime.model, context_window=0)   # every key
    prompts = {n: torch.tensor([tok(kjv_passage(tok, n) + "\n\n" + KJV_TASK).input_ids])
               for n in args.contexts}
    warm = prompts[args.contexts[0]][:, :48]
    kinds = ("target", "chain", "tree") if drafter.drafts_trees else ("target", "chain")
    for flag in modes.values():
        os.environ["SHARPDRAFT_FUSED_DRAFTERS"] = flag
        speculative_generate(runtime, drafter, warm, 8)
        if drafter.drafts_trees:
            tree_speculative_generate(runtime, drafter, warm, 8)
    autoregressive_generate(runtime, warm, 8)
    runs = {}
    outputs = {}
    jobs = [(r, n, kind, mode) for r in range(args.repeats) for n in args.contexts
            for kind in kinds for mode in (modes if kind != "target" else ["-"])]
    for _, n, kind, mode in tqdm(jobs, desc="drafting cost", unit="run"):
        if kind == "target":
            res = autoregressive_generate(runtime, prompts[n], args.new_tokens)
            runs.setdefault((n, kind, mode), []).append(
                {"step_ms": 1000 / res.decode_tokens_per_s})
            outputs.setdefault(n, res.tokens)
            continue
        os.environ["SHARPDRAFT_FUSED_DRAFTERS"] = modes[mode]
        drafter.context_window = args.context_window if mode.startswith("fused-w") else None
        run = speculative_generate if kind == "chain" else tree_speculative_generate
        kw = {"draft_threshold": 0.0} if kind == "chain" else {}
        res = run(runtime, drafter, prompts[n], args.new_tokens, **kw)
        drafted = sum(res.draft_lengths) if kind == "chain" else (
            len(res.draft_lengths) * drafter.config.tree_depth)
        runs.setdefault((n, kind, mode), []).append({
            "draft_ms_per_step": 1000 * res.draft_s / res.target_forwards,
            "draft_ms_per_token": 1000 * res.draft_s / max(1, drafted),
            "tau": res.tau, "decode_tokens_per_s": res.decode_tokens_per_s,
            "fused_draft_step": drafter.fused_step,
            "same_output": None if n not in outputs else res.tokens == outputs[n]})
    rows = []
    for (n, kind, mode), rs in runs.items():
        row = {"context": prompts[n].shape[1], "kind": kind, "mode": mode}
        for key in rs[0]:
            vals = [r[key] for r in rs if r[key] is not None]
            row[key] = (all(vals) if key == "same_output" else
                        rs[0][key] if key == "fused_draft_step" else
                        statistics.median(vals) if vals else None)
        rows.append(row)
    step = {r["context"]: r["step_ms"] for r in rows if r["kind"] == "target"}
    lines = [f"Drafting cost of {args.drafter} on the default target (GGUF blocks), "
             f"{platform.processor() or platform.machine()}, ISA {ext.cpu_isa()}, "
             f"{args.threads} threads; medians of {args.repeats} interleaved runs of "
             f"{args.new_tokens} greedy tokens after a Genesis prefix (held out) + summary "
             "task. A drafted token: chain drafts (threshold 0) or, for the tree, one "
             "expanded depth; 'x step' divides by a target-only decode step of the same "
             "context.", "",
             "| context | kind | mode | draft ms / step | draft ms / token | x step | tau | "
             "decode tok/s | same output |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["context"], r["kind"], r["mode"])):
        if r["kind"] == "target":
            lines.append(f"| {r['context']} | target-only | - | - | - | 1.00 "
                         f"({r['step_ms']:.1f} ms) | - | {1000 / r['step_ms']:.1f} | - |")
            continue
        r["token_over_step"] = r["draft_ms_per_token"] / step[r["context"]]
        lines.append(f"| {r['context']} | {r['kind']} | {r['mode']} | "
                     f"{r['draft_ms_per_step']:.2f} | {r['draft_ms_per_token']:.2f} | "
                     f"{r['token_over_step']:.3f} | {r['tau']:.2f} | "
                     f"{r['decode_tokens_per_s']:.1f} | {r['same_output']} |")
    meta = {"target": provenance, "drafter": args.drafter, "threads": args.threads,
            "context_window": args.context_window,
            "isa": ext.cpu_isa(), "new_tokens": args.new_tokens, "repeats": args.repeats}
    write_report(args.out, "drafter_step", {"settings": meta, "rows": rows}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
