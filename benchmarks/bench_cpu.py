#!/usr/bin/env python
"""CPU benchmark of the fused SharpDraft kernel (ext.sharp_attention, mode="fixed_slope").

Compares, on drafter-shaped workloads, the fused kernel against

  sdpa     torch SDPA, no scaling (plain attention: the cost floor SharpDraft must stay near)
  unfused  SharpDraft done by hand: count n_i, compute beta_i, multiply q row-wise, then SDPA
           (the count, beta and the multiply are inside the timed region)
  naive    matmul + masked softmax + matmul in the input dtype, with the beta scaling

and reports the float32 / bf16 matmul peak of the machine (torch.mm) next to each method's achieved
GFLOP/s. GFLOP counts only useful work: 4 * B * Hq * D * (number of visible (query, key) pairs),
the same for every method.

Shapes (names usable with --shapes):
  prefill-h9-d64    causal B1 H9/3kv L4096 D64          prefill-h16-d128  causal B1 H16 L4096 D128
  dflash-h9-d64     Lq16 x Lk8192 non-causal H9/3kv D64 dflash-h16-d128   same, H16 D128
  decode-h9-d64     Lq1 x Lk8192 H9/3kv D64             decode-h16-d128   same, H16 D128
  tree-h9-d64       EAGLE tree Lq16 over 4096 keys      tree-h16-d128     same, H16 D128

Usage:
  python benchmarks/bench_cpu.py --out benchmarks/results/kernel-cpu/results_cpu.md --json benchmarks/results/kernel-cpu/results_cpu.json
  python benchmarks/bench_cpu.py --quick                      # small shapes, smoke run
  python benchmarks/bench_cpu.py --dtype bfloat16 --shapes prefill,decode --repeats 7
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # progress is optional
    tqdm = None

import sharpdraft_ext as ext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SLOPE, N_REF = 0.2, 2048  # spec §1 defaults (Qwen/Llama drafters)


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------
@dataclass
class Shape:
    name: str
    kind: str  # prefill | dflash | decode | tree
    B: int
    Hq: int
    Hk: int
    Lq: int
    Lk: int
    D: int

    @property
    def causal(self) -> bool:
        return self.kind in ("prefill", "decode")

    def label(self) -> str:
        heads = f"H{self.Hq}" if self.Hq == self.Hk else f"H{self.Hq}/{self.Hk}kv"
        return f"{self.kind} B{self.B} {heads} Lq{self.Lq} Lk{self.Lk} D{self.D}"


def shapes(quick: bool) -> List[Shape]:
    L, LK, LT = (512, 1024, 512) if quick else (4096, 8192, 4096)
    out = []
    for heads, hk, d in ((9, 3, 64), (16, 16, 128)):
        tag = f"h{heads}-d{d}"
        out += [Shape(f"prefill-{tag}", "prefill", 1, heads, hk, L, L, d),
                Shape(f"dflash-{tag}", "dflash", 1, heads, hk, 16, LK, d),
                Shape(f"decode-{tag}", "decode", 1, heads, hk, 1, LK, d),
                Shape(f"tree-{tag}", "tree", 1, heads, hk, 16, LT, d)]
    order = {"prefill": 0, "dflash": 1, "decode": 2, "tree": 3}
    return sorted(out, key=lambda s: (order[s.kind], s.D))


def tree_mask(Lq: int, Lk: int, gen: torch.Generator) -> torch.Tensor:
    """EAGLE tree: keys [0, Lk - Lq) visible to all rows; node t (key Lk - Lq + t) has a random
    parent among earlier nodes; a row sees itself and its ancestors."""
    prefix = Lk - Lq
    parent = [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, Lq)]
    m = torch.zeros(Lq, Lk, dtype=torch.bool)
    m[:, :prefix] = True
    for t in range(Lq):
        a = t
        while a >= 0:
            m[t, prefix + a] = True
            a = parent[a]
    return m


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------
def row_counts(s: Shape, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """n_i per query row (Lq,), from the mask actually applied (spec §2)."""
    if mask is not None:
        return mask.sum(-1)
    if s.causal:  # bottom-right: row i sees i + Lk - Lq + 1 keys
        return torch.arange(s.Lq) + (s.Lk - s.Lq + 1)
    return torch.full((s.Lq,), s.Lk)


def beta_torch(n: torch.Tensor) -> torch.Tensor:
    """beta_fixed(n) = max(1, 1 + slope ln(n / n_ref)), in float32 (spec §1, §3)."""
    return (1.0 + SLOPE * torch.log(n.to(torch.float32) / N_REF)).clamp_min(1.0)


def make_methods(s: Shape, q, k, v, mask) -> Dict[str, Callable[[], torch.Tensor]]:
    gqa = s.Hq != s.Hk
    is_causal = s.causal and s.Lq == s.Lk
    sdpa_mask = mask
    if s.causal and s.Lq != s.Lk:
        if s.Lq == 1:  # a decode row sees every key: no mask needed
            is_causal = False
        else:
            from torch.nn.attention.bias import causal_lower_right
            sdpa_mask = causal_lower_right(s.Lq, s.Lk)
    scale = 1.0 / math.sqrt(s.D)

    def fused():
        return ext.sharp_attention(q, k, v, causal=s.causal, attn_mask=mask, mode="fixed_slope",
                                   slope=SLOPE, n_ref=N_REF)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, is_causal=is_causal,
                                              enable_gqa=gqa)

    def unfused():
        beta = beta_torch(row_counts(s, mask)).to(q.dtype)  # (Lq,)
        qs = q * beta[:, None]
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=sdpa_mask, is_causal=is_causal,
                                              enable_gqa=gqa)

    if mask is not None:
        vis = mask
    elif s.causal:
        vis = torch.ones(s.Lq, s.Lk, dtype=torch.bool).tril(s.Lk - s.Lq)
    else:
        vis = None

    def naive():
        beta = beta_torch(row_counts(s, mask))
        qs = q * (beta * scale).to(q.dtype)[:, None]
        kk = k.repeat_interleave(s.Hq // s.Hk, dim=1) if gqa else k
        vv = v.repeat_interleave(s.Hq // s.Hk, dim=1) if gqa else v
        sc = torch.matmul(qs, kk.transpose(-1, -2))
        if vis is not None:
            sc = sc.masked_fill(~vis, float("-inf"))
        return torch.matmul(torch.softmax(sc, dim=-1), vv)

    return {"fused": fused, "sdpa": sdpa, "unfused": unfused, "naive": naive}


def visible_pairs(s: Shape, mask: Optional[torch.Tensor]) -> int:
    return int(row_counts(s, mask).sum()) * s.B


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def time_ms(fn: Callable, repeats: int, warmup: int) -> Dict[str, float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts)}


def matmul_peak(dtype: torch.dtype, n: int, repeats: int) -> float:
    """GFLOP/s of an n x n x n torch.mm (median of repeats after one warm-up)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    t = time_ms(lambda: torch.mm(a, b), repeats, 1)["median_ms"]
    return 2.0 * n ** 3 / (t * 1e-3) / 1e9


@dataclass
class Result:
    shape: str
    label: str
    dtype: str
    gflop: float
    ms: Dict[str, float] = field(default_factory=dict)
    spread: Dict[str, Dict[str, float]] = field(default_factory=dict)
    gflops: Dict[str, float] = field(default_factory=dict)
    speedup: Dict[str, float] = field(default_factory=dict)  # t_method / t_fused
    max_abs_diff_vs_unfused: float = float("nan")


def run_one(s: Shape, dtype: torch.dtype, methods: List[str], repeats: int, warmup: int,
            seed: int) -> Result:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s.B, s.Hq, s.Lq, s.D, generator=g).to(dtype)
    k = torch.randn(s.B, s.Hk, s.Lk, s.D, generator=g).to(dtype)
    v = torch.randn(s.B, s.Hk, s.Lk, s.D, generator=g).to(dtype)
    mask = tree_mask(s.Lq, s.Lk, g) if s.kind == "tree" else None
    fns = make_methods(s, q, k, v, mask)
    gflop = 4.0 * s.Hq * s.D * visible_pairs(s, mask) / 1e9
    res = Result(s.name, s.label(), str(dtype).replace("torch.", ""), gflop)
    # Methods take turns within each repeat, so a load spike from elsewhere hits them alike.
    for m in methods:
        for _ in range(warmup):
            fns[m]()
    times: Dict[str, List[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for m in methods:
            times[m].append(time_ms(fns[m], 1, 0)["median_ms"])
    for m in methods:
        ts = times[m]
        st = {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts)}
        res.ms[m] = st["median_ms"]
        res.spread[m] = st
        res.gflops[m] = gflop / (st["median_ms"] * 1e-3)
    for m in methods:
        res.speedup[m] = res.ms[m] / res.ms["fused"]
    if "unfused" in methods:
        res.max_abs_diff_vs_unfused = float(
            (fns["fused"]().float() - fns["unfused"]().float()).abs().max())
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def markdown(results: List[Result], methods: List[str], peaks: Dict[str, float],
             meta: Dict[str, str]) -> str:
    lines = ["# sharpdraft CPU benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [f"- torch.mm peak {d}: {p:.1f} GFLOP/s" for d, p in peaks.items()]
    lines += ["- times: median ms; speedup = t(method) / t(fused) (> 1: fused is faster); "
              "GFLOP/s counts useful work, 4·B·Hq·D·(visible pairs), equal for all methods; "
              "% peak = fused GFLOP/s / torch.mm peak of the same dtype", ""]
    others = [m for m in methods if m != "fused"]
    head = (["shape", "dtype"] + [f"{m} ms" for m in methods]
            + [f"speedup vs {m}" for m in others]
            + [f"{m} GFLOP/s" for m in methods] + ["fused % peak", "max|fused-unfused|"])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
    for r in results:
        peak = peaks.get(r.dtype)
        row = [r.label, r.dtype]
        row += [f"{r.ms[m]:.2f}" for m in methods]
        row += [f"{r.speedup[m]:.2f}x" for m in others]
        row += [f"{r.gflops[m]:.1f}" for m in methods]
        row += [f"{100 * r.gflops['fused'] / peak:.0f}%" if peak else "-"]
        row += [f"{r.max_abs_diff_vs_unfused:.2e}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32,bfloat16",
                    help="comma list of float32, bfloat16, float16 (default float32,bfloat16)")
    ap.add_argument("--shapes", default="",
                    help="comma list of substrings selecting shapes by name, e.g. prefill,tree-h9")
    ap.add_argument("--methods", default="fused,sdpa,unfused,naive",
                    help="comma list among fused, sdpa, unfused, naive (fused is always run)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls per method")
    ap.add_argument("--quick", action="store_true", help="small shapes (L512, Lk1024) smoke run")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    ap.add_argument("--mm-size", type=int, default=0,
                    help="matrix size of the torch.mm peak (default 3072, 1024 with --quick)")
    ap.add_argument("--out", default="", help="write the Markdown table to this file")
    ap.add_argument("--json", default="", help="write all numbers as JSON to this file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtype: unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    methods = ["fused"] + [m.strip() for m in args.methods.split(",")
                           if m.strip() and m.strip() != "fused"]
    for m in methods:
        if m not in ("fused", "sdpa", "unfused", "naive"):
            ap.error(f"--methods: unknown method {m!r}")
    sel = [x.strip() for x in args.shapes.split(",") if x.strip()]
    todo = [s for s in shapes(args.quick) if not sel or any(x in s.name for x in sel)]
    if not todo:
        ap.error(f"--shapes {args.shapes!r} selects nothing; names: "
                 + ", ".join(s.name for s in shapes(args.quick)))

    meta = {
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "cpu isa (kernel dispatch)": ext.cpu_isa() if hasattr(ext, "cpu_isa") else "?",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu count": str(os.cpu_count()),
        "repeats": f"{args.repeats}, methods interleaved (warm-up {args.warmup})",
        "load average at start (1 min)": f"{os.getloadavg()[0]:.2f}",
        "beta": f"fixed_slope, slope {SLOPE}, n_ref {N_REF}, beta_min 1",
    }
    mm_n = args.mm_size or (1024 if args.quick else 3072)
    peaks = {}
    for d in dtypes:
        peaks[d] = matmul_peak(DTYPES[d], mm_n, max(3, args.repeats))
        print(f"torch.mm {mm_n}^3 {d}: {peaks[d]:.1f} GFLOP/s", file=sys.stderr)

    jobs = [(s, d) for s in todo for d in dtypes]
    bar = tqdm(jobs, desc="bench", unit="case", file=sys.stderr) if tqdm else None
    results = []
    for i, (s, d) in enumerate(jobs):
        if bar is not None:
            bar.set_postfix_str(f"{s.name} {d}")
        else:
            print(f"[{i + 1}/{len(jobs)}] {s.name} {d}", file=sys.stderr, flush=True)
        results.append(run_one(s, DTYPES[d], methods, args.repeats, args.warmup, args.seed + i))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    md = markdown(results, methods, peaks, meta)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "mm_size": mm_n, "mm_peak_gflops": peaks,
                       "methods": methods, "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
