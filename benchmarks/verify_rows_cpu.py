"""What a verification of k tokens costs against one decode step on the default runtime (GGUF
blocks, the fused decoder): issue 51's verify(k) / step(1) ratios.

After a Genesis context of each --contexts length, target forwards over k new tokens on top of
the KV cache, interleaved, medians of --repeats, the cache cropped back after each, timed two
ways: with every row's logits read (`out.logits`, what a verification cost before `RowLogits`)
and with the logits of the first two rows only (`out.row_logits[0]`, `[1]`: a chain step that
rejects its first or second draft, the common case at tau ~ 2; the LM head then runs on
`FIRST_CHUNK` = 2 rows). step(1) is k = 1 with its logits.

    python benchmarks/verify_rows_cpu.py --out benchmarks/results/verify-rows-cpu
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import sharpdraft_ext as ext
from sharpdraft.eval.bench import kjv_passage
from sharpdraft.target.loading import load_target
from sharpdraft.target.runtime import TargetRuntime


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 4000])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/verify-rows-cpu")
    args = p.parse_args()
    if 1 not in args.tokens:
        p.error("--tokens must include 1 (the decode step the ratios divide by)")
    torch.set_num_threads(args.threads)
    model, tokenizer, provenance = load_target(weights="gguf")
    runtime = TargetRuntime.prepare(model)
    gen = torch.Generator().manual_seed(0)
    runtime.start(max(args.contexts) + max(args.tokens))
    rows = []
    for ctx in tqdm(args.contexts, desc="contexts"):
        ids = tokenizer(kjv_passage(tokenizer, ctx), return_tensors="pt").input_ids[:, :ctx]
        runtime.crop(0)
        with torch.no_grad():
            runtime.forward(ids, last_only=True)
        times = {(k, read): [] for k in args.tokens for read in ("all", "two")}
        for _ in range(args.repeats + 1):            # the first round warms up
            for k in args.tokens:
                for read in ("all", "two"):
                    x = torch.randint(100, 1000, (1, k), generator=gen)
                    t = time.perf_counter()
                    out = runtime.forward(x)
                    if read == "all":
                        out.logits
                    else:
                        out.row_logits[0], out.row_logits[min(1, k - 1)]
                    times[(k, read)].append(time.perf_counter() - t)
                    runtime.crop(ctx)
        step = statistics.median(times[(1, "all")][1:])
        for k in args.tokens:
            a, b = (statistics.median(times[(k, r)][1:]) for r in ("all", "two"))
            rows.append({"context": ctx, "tokens": k, "all_rows_ms": round(1e3 * a, 2),
                         "two_rows_ms": round(1e3 * b, 2), "all_rows_steps": round(a / step, 2),
                         "two_rows_steps": round(b / step, 2)})
    runtime.finish()
    lines = [f"Target forward over k tokens after a context, default target on its GGUF blocks, "
             f"{args.threads} threads, kernels {ext.cpu_isa()} / "
             f"{ext.cpu_runtime.quant_isa()}, {platform.processor() or platform.machine()}; "
             f"medians of {args.repeats} interleaved repeats. steps = ms / the k = 1 forward "
             f"at the same context.", "",
             "| context | k | all rows' logits ms | steps | first two rows' logits ms | steps |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['tokens']} | {r['all_rows_ms']} | {r['all_rows_steps']} | "
              f"{r['two_rows_ms']} | {r['two_rows_steps']} |" for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"threads": args.threads, "repeats": args.repeats, "cpu_isa": ext.cpu_isa(),
              "quant_isa": ext.cpu_runtime.quant_isa(), "target": provenance,
              "runtime": runtime.info, "forward": rows}
    tmp = out / "verify_rows.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.rename(out / "verify_rows.json")
    (out / "verify_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
