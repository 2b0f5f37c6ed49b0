"""Held-out acceptance of drafter checkpoints, side by side: greedy speculative decoding of the
corpus's held-out prompts (Genesis passages, held-out champ problems, HumanEval tasks and
stdlib files: text no drafter was trained on) with each drafter, SharpDraft off (the drafter as
trained; tau does not depend on timing). For comparing a checkpoint before and after a change of
architecture (the move of the shipped drafters to the public layouts).

    python benchmarks/heldout_tau_cpu.py --prompts 12 --max-new-tokens 96 \
        --drafter before=python/sharpdraft/checkpoints/pard-smollm2 --drafter after=runs/pard \
        --out benchmarks/results/public-architecture-cpu/pard

Writes tau.json (per prompt and drafter: tau, tokens, target forwards; the prompt's source and
kind) and tau.md (a table of mean tau), and checks that every drafter's tokens equal the
first's (greedy decoding is lossless, so they must).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from sharpdraft import generate, load_drafter, load_target
from sharpdraft.data.prompts import build_prompts, render


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", required=True, metavar="LABEL=FOLDER",
                   help="a drafter checkpoint folder and its label (repeat)")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts, in corpus order")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tree", action="store_true", help="tree drafting (EAGLE-3)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pairs = [d.split("=", 1) for d in args.drafter]
    if any(len(x) != 2 for x in pairs):
        sys.exit("--drafter must be LABEL=FOLDER")
    target, tokenizer, info = load_target()
    drafters = {label: load_drafter(folder, target, sharp=False) for label, folder in pairs}
    prompts = build_prompts("heldout")[0][:args.prompts]
    rows = []
    for prompt in tqdm(prompts, desc="held-out prompts"):
        ids = torch.tensor([render(tokenizer, [{"role": "user", "content": prompt.user}])])
        row = {"source": prompt.source, "kind": prompt.kind, "prompt_tokens": ids.shape[1]}
        first = None
        for label, drafter in drafters.items():
            res = generate(target, drafter, ids, max_new_tokens=args.max_new_tokens,
                           tree=args.tree, eos_token_id=tokenizer.eos_token_id)
            if first is None:
                first = res.tokens
            elif res.tokens != first:
                sys.exit(f"{label}: tokens differ from {pairs[0][0]}'s (greedy must be lossless)")
            row[label] = {"tau": res.tau, "new_tokens": res.new_tokens,
                          "target_forwards": res.target_forwards}
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    means = {label: statistics.mean(r[label]["tau"] for r in rows) for label, _ in pairs}
    (out / "tau.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "drafters": dict(pairs), "target": info.get("source"),
         "tree": args.tree, "max_new_tokens": args.max_new_tokens, "mean_tau": means,
         "prompts": rows}, indent=2))
    lines = ["| drafter | folder | mean tau |", "|---|---|---|"]
    lines += [f"| {label} | `{folder}` | {means[label]:.3f} |" for label, folder in pairs]
    lines += ["", f"{len(rows)} held-out prompts (corpus order), greedy, "
              f"{args.max_new_tokens} new tokens, SharpDraft off"
              + (", tree drafting" if args.tree else "") + f"; `{' '.join(sys.argv)}`"]
    (out / "tau.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
