"""The quantised panel kernel alone (`sharpdraft_ext.cpu_runtime.quant_linear`) by row count:
what one GGUF linear costs for the rows of a decode step and of a verification.

Random weights of each --shape, quantised by gguf-py to each --qtypes, packed for this CPU.
"streamed": one call on each of --weights distinct weights in turn (they come from memory, as
in a forward); "in cache": the same weight every call (compute and call cost only). Microseconds
per call, medians of --repeats passes, the row counts in turn within a pass; "floor" is one call
on a 16 x 32 weight (the op's dispatch, the activation quantisation, the thread hand-off), and
"ns / vpdpbusd" the in-cache time less the floor over rows * n * k / 64 (64 int8 products: one
512-bit VNNI instruction).

    python benchmarks/quant_kernel_cpu.py --threads 2 --out benchmarks/results/quant-kernel-cpu

Writes quant_kernel.json, quant_kernel.md and quant_kernel.png to --out.
"""
import argparse
import platform
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from tqdm import tqdm

from sharpdraft.eval.report import figure, write_report
from sharpdraft_ext import cpu_runtime


def packed_weights(qtype, n, k, count, seed=0):
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[qtype.upper()]
    out = []
    for _ in range(count):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        blocks = torch.from_numpy(np.ascontiguousarray(gguf_quants.quantize(w, kind)))
        out.append(cpu_runtime.quant_pack(blocks, qtype, n, k))
    return out


def per_call_us(packs, x, qtype, n, calls):
    t0 = time.perf_counter()
    for i in range(calls):
        cpu_runtime.quant_linear(x, packs[i % len(packs)], qtype, n)
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1536x576", "576x1536"],
                   help="n x k (out x in features); the default target's MLP shapes")
    p.add_argument("--qtypes", nargs="+", default=["q4_1", "q8_0"], choices=cpu_runtime.QTYPES)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--weights", type=int, default=60)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/quant-kernel-cpu")
    args = p.parse_args()
    shapes = []
    for s in args.shapes:
        try:
            n, k = (int(v) for v in s.lower().split("x"))
        except ValueError:
            p.error(f"--shapes: {s!r} is not N x K (for example 1536x576)")
        if n < 1 or k < 32 or k % 32:
            p.error(f"--shapes: {s!r} needs n >= 1 and k a positive multiple of 32")
        shapes.append((n, k))
    if args.weights < 1 or args.repeats < 1 or min(args.rows) < 1:
        p.error("--weights, --repeats and --rows must be positive")
    torch.set_num_threads(args.threads)
    tiny = {q: packed_weights(q, 16, 32, 1) for q in args.qtypes}
    results = []
    for (n, k) in shapes:
        for qtype in args.qtypes:
            packs = packed_weights(qtype, n, k, args.weights)
            xs = {r: torch.randn(r, k, generator=torch.Generator().manual_seed(r))
                  for r in args.rows}
            times = {(r, m): [] for r in args.rows for m in ("streamed", "cache", "floor")}
            for _ in tqdm(range(args.repeats), desc=f"{qtype} {n}x{k}", leave=False):
                for r in args.rows:
                    times[(r, "streamed")].append(per_call_us(packs, xs[r], qtype, n, len(packs)))
                    times[(r, "cache")].append(per_call_us(packs[:1], xs[r], qtype, n, len(packs)))
                    times[(r, "floor")].append(
                        per_call_us(tiny[qtype], xs[r][:, :32].contiguous(), qtype, 16, len(packs)))
            one = statistics.median(times[(args.rows[0], "streamed")])
            for r in args.rows:
                med = {m: statistics.median(times[(r, m)]) for m in ("streamed", "cache", "floor")}
                results.append({
                    "qtype": qtype, "n": n, "k": k, "rows": r,
                    "streamed_us": round(med["streamed"], 2), "cache_us": round(med["cache"], 2),
                    "floor_us": round(med["floor"], 2),
                    "streamed_vs_first": round(med["streamed"] / one, 2),
                    "ns_per_vpdpbusd": round((med["cache"] - med["floor"]) * 1e3
                                             / (r * n * k / 64) * args.threads, 3)})
    result = {"threads": args.threads, "quant_isa": cpu_runtime.quant_isa(),
              "panel_width": cpu_runtime.quant_panel_width(), "machine": platform.machine(),
              "weights": args.weights, "repeats": args.repeats, "results": results}
    lines = [f"Quantised panel kernel ({result['quant_isa']}, panel width "
             f"{result['panel_width']}), {args.threads} threads, microseconds per call, medians of "
             f"{args.repeats} passes; streamed over {args.weights} distinct weights; ns / vpdpbusd "
             f"is a thread's time per 64 products in cache, the call floor taken off.", "",
             "| qtype | n x k | rows | streamed us | vs first rows | in cache us | floor us | "
             "ns / vpdpbusd |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['qtype']} | {r['n']}x{r['k']} | {r['rows']} | {r['streamed_us']} | "
              f"{r['streamed_vs_first']} | {r['cache_us']} | {r['floor_us']} | "
              f"{r['ns_per_vpdpbusd']} |" for r in results]
    fig, ax = figure(figsize=(5.5, 3.6))
    for (n, k) in shapes:
        for qtype in args.qtypes:
            rs = [r for r in results if (r["n"], r["k"], r["qtype"]) == (n, k, qtype)]
            ax.plot([r["rows"] for r in rs], [r["streamed_us"] for r in rs], marker="o",
                    label=f"{qtype} {n}x{k}")
    ax.set_xlabel("rows")
    ax.set_ylabel("us per call (streamed)")
    ax.set_title(f"quantised panel kernel, {result['quant_isa']}, {args.threads} threads")
    ax.legend(fontsize=7)
    write_report(args.out, "quant_kernel", result, lines, figure=fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
