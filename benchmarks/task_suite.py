"""The held-out task suite (`sharpdraft.data.tasks.suite`) for several drafters in one run:
target-only decoding once per prompt, then every drafter frozen and with SharpDraft, on the
default runtime (`--weights auto`, `--dtype auto`, as the command line), under both draft
policies (fixed and auto, `--policies`), so every speedup is against target-only decoding in the
same process. Writes bench.json / bench.md (a table per prompt and one by category) /
speedup_by_kind.png to --out.

    python benchmarks/task_suite.py --out benchmarks/results/tasks-cpu
    python benchmarks/task_suite.py --drafters eagle3 --no-trees --policies fixed \
        --context-window 0 --out benchmarks/results/tasks-cpu-window
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import sharpdraft
from sharpdraft.data.tasks import SUITE
from sharpdraft.drafters import registry
from sharpdraft.eval.bench import bench_variants, run_bench, suite_prompts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafters", nargs="+", default=["dflash", "eagle3", "pard", "longspark"])
    p.add_argument("--categories", nargs="+", default=list(SUITE), choices=SUITE)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-threshold", type=float, default=None,
                   help="chain drafting's draft threshold for every drafter (default: each "
                        "drafter's measured draft_threshold, as the command line)")
    p.add_argument("--policies", nargs="+", default=["fixed", "auto"], choices=["fixed", "auto"],
                   help="the draft policies every drafter runs under (labels of auto end -auto)")
    p.add_argument("--context-window", type=int, default=None,
                   help="also run every drafter that takes a context window with this one "
                        "(labels <kind>-w<W>; 0: every key, <kind>-all-keys), beside its "
                        "default")
    p.add_argument("--attention-sinks", type=int, default=0,
                   help="sink keys of the --context-window variants (labels <kind>-w<W>+<S>)")
    p.add_argument("--no-trees", action="store_true", help="chain drafting only")
    p.add_argument("--out", default="benchmarks/results/tasks-cpu")
    args = p.parse_args()
    if args.attention_sinks and not args.context_window:
        p.error("--attention-sinks needs --context-window W >= 1")
    torch.set_num_threads(args.threads)
    target, tokenizer, info = sharpdraft.load_target(weights=args.weights, dtype=args.dtype)
    variants = {}
    for kind in args.drafters:
        entry = registry.get(kind)
        windows = [None] + ([args.context_window] if args.context_window is not None
                            and entry.cls.supports_context_window else [])
        for window in windows:
            drafter = sharpdraft.load_drafter(
                kind, target, tokenizer=tokenizer, context_window=window,
                attention_sinks=args.attention_sinks if window else 0)
            label = (kind if window is None else f"{kind}-all-keys" if window == 0 else
                     f"{kind}-w{window}" + (f"+{args.attention_sinks}" if args.attention_sinks
                                            else ""))
            variants.update(bench_variants(label, drafter, entry.trees and not args.no_trees))
    prompts = suite_prompts(tokenizer, args.categories)
    run_bench(target, tokenizer, variants, prompts, args.max_new_tokens, None, Path(args.out),
              draft_threshold=args.draft_threshold, target_info=info, policies=args.policies)
    print((Path(args.out) / "bench.md").read_text())


if __name__ == "__main__":
    main()
