"""Chain drafting's draft threshold on the held-out task suite: for every chain drafter and
threshold, decode speedup and tau per category against target-only decoding in the same run.

A threshold p verifies a step's drafts only up to the first whose drafter probability is below
p (`speculative_generate(draft_threshold=p)`; EAGLE-3 also stops drafting there). On a CPU a
verification costs more with every row, so fewer, likelier drafts can pay although tau falls.
SharpDraft is on as each drafter is configured; greedy, so every run must equal target-only
output. Writes results.json, table.md and speedup_vs_threshold.png to --out; with --write,
also each shipped checkpoint's measured default (config.json's draft_threshold, what
`sharpdraft.generate` and the CLI use when given none): the threshold with the best
geometric-mean decode speedup over the suite's prompts.

    python benchmarks/draft_threshold_cpu.py --out benchmarks/results/draft-threshold-cpu --write
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

import sharpdraft
from sharpdraft.data.tasks import SUITE
from sharpdraft.drafters.loading import shipped_checkpoint
from sharpdraft.eval.bench import decode, suite_prompts, warm_up
from sharpdraft.eval.report import write_json
from sharpdraft.inference.engine import autoregressive_generate


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarise(runs, drafters, thresholds, kinds):
    """{drafter: {threshold: {"by_kind": {kind: (mean tau, geomean decode speedup)},
    "geomean": ..., "identical": n, "runs": n}}}."""
    out = {}
    for d in drafters:
        out[d] = {}
        for t in thresholds:
            key = f"{d}@{t:g}"
            by_kind = {}
            for k in kinds:
                rs = [r[key] for r in runs if r["kind"] == k]
                by_kind[k] = (sum(x["tau"] for x in rs) / len(rs),
                              geomean(x["decode_speedup"] for x in rs))
            out[d][f"{t:g}"] = {"by_kind": by_kind,
                                "geomean": geomean(r[key]["decode_speedup"] for r in runs),
                                "identical": sum(r[key]["identical_to_ar"] for r in runs),
                                "runs": len(runs)}
    return out


def table(summary, kinds) -> str:
    lines = ["Decode speedup against target-only decoding in the same run (tau in brackets), "
             "greedy, SharpDraft on.", "",
             "| drafter | threshold | " + " | ".join(kinds) + " | geomean | identical |",
             "|---|---:|" + "---:|" * len(kinds) + "---:|---:|"]
    for d, per in summary.items():
        for t, s in per.items():
            cells = [f"{sp:.2f}x ({tau:.2f})" if sp else f"n/a ({tau:.2f})"
                     for tau, sp in (s["by_kind"][k] for k in kinds)]
            g = f"{s['geomean']:.2f}x" if s["geomean"] else "n/a"
            lines.append(f"| {d} | {t} | " + " | ".join(cells)
                         + f" | {g} | {s['identical']}/{s['runs']} |")
    return "\n".join(lines) + "\n"


def plot(summary, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d, per in summary.items():
        ts = [float(t) for t in per]
        ax.plot(ts, [per[t]["geomean"] or float("nan") for t in per], marker="o", label=d)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("draft threshold (drafter probability)")
    ax.set_ylabel("decode speedup, geometric mean")
    ax.set_title("Chain drafting on the held-out task suite")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_threshold(kind: str, threshold: float) -> Path:
    """Set draft_threshold in the shipped `kind` checkpoint's config.json (`write_json`:
    temporary name, then renamed); returns the file."""
    path = shipped_checkpoint(kind) / "config.json"
    return write_json(path, {**json.loads(path.read_text()), "draft_threshold": threshold})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafters", nargs="+", default=["eagle3", "dflash", "pard", "longspark"])
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.2, 0.3, 0.4, 0.5, 0.6])
    p.add_argument("--categories", nargs="+", default=list(SUITE), choices=SUITE)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/draft-threshold-cpu")
    p.add_argument("--write", action="store_true",
                   help="write each drafter's best threshold into its shipped checkpoint's "
                        "config.json (draft_threshold)")
    args = p.parse_args()
    for t in args.thresholds:
        if not 0.0 <= t <= 1.0:
            p.error(f"--thresholds: {t} is not in [0, 1]")
    torch.set_num_threads(args.threads)
    target, tokenizer, info = sharpdraft.load_target(weights="auto", dtype="auto")
    drafters = {d: sharpdraft.load_drafter(d, target, tokenizer=tokenizer) for d in args.drafters}
    prompts = suite_prompts(tokenizer, args.categories)
    for d in drafters.values():
        warm_up(target, d, prompts[0]["ids"])
    eos, runs = tokenizer.eos_token_id, []
    for pr in tqdm(prompts, desc="suite prompts", unit="prompt"):
        ar = autoregressive_generate(target, pr["ids"], args.max_new_tokens, eos_token_id=eos)
        row = {"name": pr["name"], "kind": pr["kind"], "prompt_tokens": pr["ids"].shape[1],
               "ar": ar.summary()}
        for name, d in drafters.items():
            for t in args.thresholds:
                res = decode(target, d, pr["ids"], args.max_new_tokens, eos_token_id=eos,
                             draft_threshold=t)
                s = res.summary()
                row[f"{name}@{t:g}"] = {**s, "decode_speedup": (
                    s["decode_tokens_per_s"] / row["ar"]["decode_tokens_per_s"]
                    if s["decode_tokens_per_s"] and row["ar"]["decode_tokens_per_s"] else None),
                    "identical_to_ar": res.tokens == ar.tokens}
        runs.append(row)
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    summary = summarise(runs, list(drafters), args.thresholds, kinds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"settings": {"max_new_tokens": args.max_new_tokens, "threads": args.threads,
                           "thresholds": args.thresholds, "target": info},
              "summary": summary, "runs": runs}
    write_json(out / "results.json", record, indent=1)
    (out / "table.md").write_text(table(summary, kinds))
    plot(summary, out / "speedup_vs_threshold.png")
    print((out / "table.md").read_text())
    if args.write:
        for d, per in summary.items():
            best = max(per, key=lambda t: per[t]["geomean"] or 0.0)
            print(f"{d}: draft_threshold {best} -> {write_threshold(d, float(best))}")


if __name__ == "__main__":
    main()
