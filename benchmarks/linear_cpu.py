"""The CPU linear paths of the target runtime on the default target's shapes, and what the panel
kernel buys a whole verification forward.

1. Per shape: `F.linear` ("dense"), oneDNN's prepacked weight ("onednn") and sharpdraft_ext's
   panel kernel ("panel"), each streamed over as many distinct weights of that shape as the
   target holds (so they come from memory, as in a forward), at --rows rows; microseconds per
   call (median of --repeats passes, the paths in turn within each pass) and the weight bytes
   read per second.
2. Whole forward: `TargetRuntime` over n tokens after a Genesis context of --context tokens,
   prepared once with the panel kernel among its paths and once without (dense and oneDNN only),
   the two timed in turn, medians; "steps" = the forward's cost over the one-row forward of the
   runtime without the panel kernel (a target-only decode step).

Writes linear.json, linear.md and linear.png to --out.

    python benchmarks/linear_cpu.py --threads 2 --out benchmarks/results/linear-cpu
"""
import argparse
import json
import os
import statistics
import time
from collections import Counter

import torch
import torch.nn.functional as F
from tqdm import tqdm

import sharpdraft_ext as ext
from sharpdraft.eval.bench import kjv_passage
from sharpdraft.eval.report import figure, write_report
from sharpdraft.target.loading import load_target
from sharpdraft.target.linears import ROW_REGIMES
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_ext import cpu_runtime

PATHS = ("dense", "onednn", "panel")


def per_shape(model, rows, repeats):
    """[{shape, rows, path: us per call, path_gbs: GB/s}] over the model's linear shapes."""
    counts = Counter((m.out_features, m.in_features) for m in model.modules()
                     if isinstance(m, torch.nn.Linear))
    out = []
    for (n, k), count in tqdm(sorted(counts.items()), desc="shapes"):
        g = torch.Generator().manual_seed(n * k)
        ws = [torch.randn(n, k, generator=g) for _ in range(count)]
        packed = {"onednn": [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws],
                  "panel": [cpu_runtime.pack_linear_weight(w) for w in ws]}
        run = {"dense": lambda x: [F.linear(x, w) for w in ws],
               "onednn": lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                    for p in packed["onednn"]],
               "panel": lambda x: [cpu_runtime.packed_linear(x, p, n) for p in packed["panel"]]}
        for m in rows:
            x = torch.randn(m, k, generator=g)
            times = {p: [] for p in PATHS}
            for _ in range(repeats + 1):
                for p in PATHS:
                    t = time.perf_counter()
                    run[p](x)
                    times[p].append(time.perf_counter() - t)
            row = {"shape": f"{n}x{k}", "weights": count, "rows": m}
            for p in PATHS:
                us = 1e6 * statistics.median(times[p][1:]) / count
                row[p] = round(us, 1)
                row[f"{p}_gbs"] = round(n * k * 4 / us / 1e3, 1)
            out.append(row)
    return out


def whole_forward(model, ids, lengths, repeats):
    """{n: {"without": ms, "with": ms}} and the two plans."""
    runtimes, plans = {}, {}
    for name, paths in (("without", ("dense", "onednn")), ("with", PATHS)):
        os.environ["SHARPDRAFT_LINEAR_PATHS"] = ",".join(paths)   # read by the measured plan
        runtimes[name] = TargetRuntime.prepare(model, "measure")
        plans[name] = runtimes[name].info["linear_plan"]
        runtimes[name].start(ids.shape[1] + max(lengths) + 1)
        runtimes[name].forward(ids, last_only=True)
    gen = torch.Generator().manual_seed(0)
    times = {(name, n): [] for name in runtimes for n in lengths}
    with torch.no_grad():
        for _ in tqdm(range(repeats + 1), desc="forwards"):
            for n in lengths:
                x = torch.randint(100, 1000, (1, n), generator=gen)
                for name, r in runtimes.items():
                    t = time.perf_counter()
                    r.forward(x)
                    times[(name, n)].append(time.perf_counter() - t)
                    r.crop(ids.shape[1])
    ms = {n: {name: round(1e3 * statistics.median(times[(name, n)][1:]), 1) for name in runtimes}
          for n in lengths}
    return ms, plans


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6, 8, 17])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 17])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/linear-cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, provenance = load_target()
    shapes = per_shape(model, args.rows, args.repeats)
    ids = tokenizer(kjv_passage(tokenizer, args.context), return_tensors="pt").input_ids
    forward, plans = whole_forward(model, ids[:, :args.context], args.lengths, args.repeats)
    one = forward[1]["without"] if 1 in forward else None
    result = {"threads": args.threads, "isa": ext.cpu_isa(),
              "panel_width": cpu_runtime.panel_width(), "target": provenance,
              "per_shape": shapes, "context": args.context, "forward_ms": forward,
              "plans": plans}
    lines = [f"CPU linear paths, float32, {args.threads} threads, {ext.cpu_isa()} (panel width "
             f"{cpu_runtime.panel_width()}). Per shape: microseconds per call streamed over the "
             f"target's weights of that shape (GB/s of weights read), median of "
             f"{args.repeats} passes, paths in turn.", "",
             "| shape | weights | rows | dense us | oneDNN us | panel us | dense GB/s | "
             "panel GB/s | panel speedup |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['weights']} | {r['rows']} | {r['dense']} | {r['onednn']} | "
              f"{r['panel']} | {r['dense_gbs']} | {r['panel_gbs']} | "
              f"{min(r['dense'], r['onednn']) / r['panel']:.2f}x |" for r in shapes]
    lines += ["", f"Whole target forward over n tokens after {args.context} tokens of Genesis, "
              f"`TargetRuntime` with and without the panel kernel among its measured paths "
              f"(timed in turn, medians of {args.repeats}); steps = ms / the one-row forward "
              f"without it.", "",
              "| tokens | without ms | with ms | without steps | with steps | saved |",
              "|---:|---:|---:|---:|---:|---:|"]
    for n, v in forward.items():
        steps = (f"{v['without'] / one:.2f} | {v['with'] / one:.2f}" if one else "- | -")
        lines.append(f"| {n} | {v['without']} | {v['with']} | {steps} | "
                     f"{1 - v['with'] / v['without']:.0%} |")
    lines += ["", "Plans (path at each row count plan_linears measures: "
              f"{', '.join(str(m) for _, m in ROW_REGIMES)}):", "",
              *(f"- {k}: {json.dumps(v)}" for k, v in plans.items())]

    fig, ax = figure(figsize=(5.5, 3.6))
    ns = list(forward)
    for name, marker in (("without", "o"), ("with", "s")):
        ax.plot(ns, [forward[n][name] for n in ns], marker=marker,
                label=f"{name} the panel kernel")
    ax.set_xlabel("tokens in the forward (drafts + 1)")
    ax.set_ylabel("ms per target forward")
    ax.set_title(f"Target forward after {args.context} tokens (CPU, {args.threads} threads)")
    ax.grid(alpha=0.3)
    ax.legend()
    write_report(args.out, "linear", result, lines, figure=fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
