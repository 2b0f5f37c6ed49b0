"""Cost of one target verification forward against its length, on the default target (CPU).

A speculative step verifies [last ; drafts] in one target forward on top of the KV cache; on a CPU
its cost grows with the number of tokens, which sets the tau a drafter needs to pay off. This
times forwards of 1, 6 (EAGLE-3 chain), 8 (DFlash block), 9 (PARD) and 17 (EAGLE-3 tree) tokens
after a Genesis context (median of --repeats, the cache cropped back after each) and writes
JSON + Markdown.

    python benchmarks/verify_cost_cpu.py --context 2048 --threads 2 --out benchmarks/verify_cost_cpu
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from sharpdraft.bench import kjv_passage
from sharpdraft.models import load_target


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=2048, help="context tokens (Genesis)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 6, 8, 9, 17])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/verify_cost_cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer, provenance = load_target()
    ids = tokenizer(kjv_passage(tokenizer, args.context), return_tensors="pt").input_ids
    gen = torch.Generator().manual_seed(0)
    ms = {}
    with torch.no_grad():
        cache = DynamicCache()
        target(ids, cache=cache, use_cache=True)
        for n in args.lengths:
            times = []
            for _ in range(args.repeats):
                x = torch.randint(100, 1000, (1, n), generator=gen)
                t0 = time.perf_counter()
                target(x, cache=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                cache.crop(-n)
            ms[n] = 1000 * statistics.median(times)
    rows = [{"tokens": n, "ms": round(ms[n], 1), "single_steps": round(ms[n] / ms[1], 2)}
            for n in args.lengths]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps(
        {"context_tokens": ids.shape[1], "threads": args.threads, "repeats": args.repeats,
         "target": provenance, "rows": rows}, indent=2) + "\n")
    lines = [f"Target forward over n tokens after a {ids.shape[1]}-token context, fp32, "
             f"{args.threads} threads, median of {args.repeats}.", "",
             "| tokens | ms | single-token steps |", "|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['ms']} | {r['single_steps']} |" for r in rows]
    (out / "verify_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
