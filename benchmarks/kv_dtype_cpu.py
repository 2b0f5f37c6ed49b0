"""What a 16-bit KV cache buys the target runtime: the CPU sharp kernel's time for one decode
step's or one verification's attention over every layer (30 distinct caches of the default
target's shape: 3 KV heads, 9 query heads, head dim 64), keys and values in float32, float16 or
bfloat16, at several contexts. The kernel reads 16-bit keys and values and converts them a
block at a time, so this is the attention part of a step with such a cache (the dtype the
runtime's plan chooses, `target.plan.auto_kv_dtype`). Medians of --reps runs after 2
warm-ups; writes JSON. With --decode, end to end instead: target-only greedy decoding of
--new-tokens tokens after the first n tokens of Genesis (held out) on the default GGUF target,
one runtime per KV dtype (`RuntimePlan.kv_dtype`), interleaved --reps times, decode tokens/s
(prefill excluded), and whether each dtype's text equals float32's.

    python benchmarks/kv_dtype_cpu.py --threads 2 --out benchmarks/results/kv-dtype-cpu/kv_dtype.json
    python benchmarks/kv_dtype_cpu.py --decode --contexts 1024 4000 7000 --reps 5 \
        --out benchmarks/results/kv-dtype-cpu/decode.json

With --perplexity: the default target's teacher-forced perplexity over the first 2,047 tokens
of two held-out texts (Genesis; GPL-3 from /usr/share/common-licenses, evaluation only) through
the runtime in 64-token forwards, per KV dtype.

    python benchmarks/kv_dtype_cpu.py --perplexity --out benchmarks/results/kv-dtype-cpu/perplexity.json
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
    p.add_argument("--decode", action="store_true",
                   help="end to end: target-only decode tokens/s on the default GGUF target")
    p.add_argument("--perplexity", action="store_true",
                   help="held-out perplexity of the default GGUF target per KV dtype")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/kv-dtype-cpu/kv_dtype.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.perplexity:
        return perplexity(args)
    if args.decode:
        return decode(args)
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


def target_runtimes():
    """The default GGUF target's runtimes, one per KV dtype (the auto plan otherwise):
    ({dtype name: runtime}, tokenizer, provenance)."""
    import dataclasses

    from sharpdraft.target.loading import load_target
    from sharpdraft.target.plan import KV_DTYPES, auto_plan
    from sharpdraft.target.runtime import TargetRuntime

    model, tok, provenance = load_target(weights="gguf")
    base = auto_plan(model)
    return ({kv: TargetRuntime.prepare(model, dataclasses.replace(base, kv_dtype=kv))
             for kv in KV_DTYPES}, tok, provenance)


def decode(args) -> None:
    from tqdm import tqdm

    from sharpdraft.eval.bench import kjv_passage
    from sharpdraft.inference.engine import autoregressive_generate

    runtimes, tok, provenance = target_runtimes()
    prompts = {n: torch.tensor([tok(kjv_passage(tok, n)).input_ids]) for n in args.contexts}
    for rt in runtimes.values():                                  # warm-up
        autoregressive_generate(rt, prompts[args.contexts[0]][:, :64], 8)
    speeds, texts = {}, {}
    jobs = [(r, n, kv) for r in range(args.reps) for n in args.contexts for kv in runtimes]
    for _, n, kv in tqdm(jobs, desc="decode by KV dtype", unit="run"):
        res = autoregressive_generate(runtimes[kv], prompts[n], args.new_tokens)
        speeds.setdefault((n, kv), []).append(res.decode_tokens_per_s)
        texts[(n, kv)] = res.tokens
    rows = [{"context": prompts[n].shape[1], "kv_dtype": kv,
             "decode_tokens_per_s": round(statistics.median(speeds[(n, kv)]), 2),
             "over_float32": round(statistics.median(speeds[(n, kv)])
                                   / statistics.median(speeds[(n, "float32")]), 3),
             "same_text_as_float32": texts[(n, kv)] == texts[(n, "float32")]}
            for n in args.contexts for kv in runtimes]
    for r in rows:
        print(r)
    meta = {"threads": args.threads, "reps": args.reps, "new_tokens": args.new_tokens,
            "cpu": platform.processor() or platform.machine(), "isa": ext.cpu_isa(),
            "target": provenance, "mode": "decode"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    tmp.write_text(json.dumps({"settings": meta, "results": rows}, indent=2) + "\n")
    tmp.replace(out)


def perplexity(args, tokens: int = 2048, chunk: int = 64) -> None:
    import math

    from sharpdraft.eval.bench import kjv_passage

    runtimes, tok, provenance = target_runtimes()
    texts = {"genesis": kjv_passage(tok, tokens),
             "GPL-3": Path("/usr/share/common-licenses/GPL-3").read_text()[:6 * tokens]}
    rows = []
    for name, text in texts.items():
        ids = torch.tensor([tok(text).input_ids[:tokens]])
        for kv, rt in runtimes.items():
            nll, n = 0.0, 0
            with rt.session(ids.shape[1] + 8):
                for s in range(0, ids.shape[1] - 1, chunk):
                    logits = rt.forward(ids[:, s:s + chunk]).logits.float()
                    target = ids[0, s + 1:s + 1 + chunk]
                    logp = torch.log_softmax(logits[:len(target)], -1)
                    nll -= float(logp[torch.arange(len(target)), target].sum())
                    n += len(target)
            rows.append({"text": name, "kv_dtype": kv, "tokens": n,
                         "perplexity": round(math.exp(nll / n), 4)})
            print(rows[-1], flush=True)
    meta = {"threads": args.threads, "cpu": platform.processor() or platform.machine(),
            "isa": ext.cpu_isa(), "target": provenance, "mode": "perplexity"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    tmp.write_text(json.dumps({"settings": meta, "results": rows}, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
