"""What a 16-bit KV cache would buy the target runtime: the CPU sharp kernel's time for one
decode step's or one verification's attention over every layer (30 distinct caches of the
default target's shape: 3 KV heads, 9 query heads, head dim 64), keys and values in float32,
float16 or bfloat16, at several contexts. The kernel reads 16-bit keys and values and converts
them a block at a time, so this is the attention part of a step with such a cache (the runtime
itself keeps float32 today). Medians of --reps runs after 2 warm-ups; writes JSON.

    python benchmarks/kv_dtype_cpu.py --threads 2 --out benchmarks/results/kv-dtype-cpu/kv_dtype.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import sharpdraft_ext as ext


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4000, 7000])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="query tokens per call")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/kv-dtype-cpu/kv_dtype.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in args.contexts:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ks = [torch.randn(1, 3, ctx, 64, generator=g).to(dtype) for _ in range(args.layers)]
            vs = [torch.randn(1, 3, ctx, 64, generator=g).to(dtype) for _ in range(args.layers)]
            for n in args.rows:
                q = torch.randn(1, 9, n, 64, generator=g).to(dtype)
                times = []
                for _ in range(args.reps + 2):
                    t0 = time.perf_counter()
                    for k, v in zip(ks, vs):
                        ext.sharp_attention(q, k, v, causal=True, mode="none")
                    times.append(time.perf_counter() - t0)
                ms = statistics.median(times[2:]) * 1000
                rows.append({"context": ctx, "kv_dtype": str(dtype)[6:], "rows": n,
                             "ms_all_layers": round(ms, 2)})
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "layers": args.layers, "reps": args.reps,
            "cpu": platform.processor() or platform.machine(), "isa": ext.cpu_isa()}
    tmp = out.with_suffix(".partial")
    tmp.write_text(json.dumps({"settings": meta, "results": rows}, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
