"""The target runtime's benchmark: one target forward over n tokens against its length, and
target-only decoding speed, on the default target (CPU), next to the hardware floor.

1. Forward cost. After a Genesis context of each --contexts length, forwards over n tokens (the
   verification of n - 1 drafts) on top of the KV cache, for Hugging Face's own forward (SDPA,
   DynamicCache, nn.Linear: what users run) and for `sharpdraft.target.TargetRuntime`; the two
   are interleaved, median of --repeats, the cache cropped back after each. The floor of a
   forward is max(bytes read / measured read bandwidth, FLOPs / measured GEMM peak), with bytes =
   the weights + the KV cache, and FLOPs = 2 x parameters x n + the attention's 4 x n x context x
   heads x head dim per layer.
2. Target-only decoding (greedy) on the main job's prompt: HF `generate`, our
   `autoregressive_generate`, and llama.cpp (`llama-cpp-python`, when installed) on the same
   GGUF file the target is converted from; decode tokens/s exclude the prefill.

Writes verify_cost.json, verify_cost.md and verify_cost.png to --out.

    python benchmarks/verify_cost_cpu.py --threads 2 --out benchmarks/results/verify-cost-cpu
"""
import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from sharpdraft.eval.bench import KJV_TASK, kjv_passage
from sharpdraft.eval.report import figure, write_report
from sharpdraft.inference.engine import autoregressive_generate
from sharpdraft.target.loading import default_gguf, load_target
from sharpdraft.target.runtime import TargetRuntime


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """Read bandwidth: sum over a 1 GiB float32 tensor (median GB/s)."""
    x = torch.ones(1 << 28)
    x.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def gemm_peak_gflops(repeats: int = 5, n: int = 2048) -> float:
    """float32 GEMM throughput of a large square matmul (median GFLOP/s)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(ts) / 1e9


def floor_ms(cfg, params: int, context: int, n: int, bw: float, peak: float) -> float:
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * (context + n) * 4
    flops = 2 * params * n + 4 * n * (context + n) * cfg.num_attention_heads * d \
        * cfg.num_hidden_layers
    return 1e3 * max((params * 4 + kv_bytes) / (bw * 1e9), flops / (peak * 1e9))


def forward_costs(hf, ours, ids, lengths, repeats, gen):
    """{n: (HF ms, runtime ms)} after the context `ids`, interleaved, medians."""
    ctx = ids.shape[1]
    with torch.no_grad():
        cache = DynamicCache()
        hf(ids, cache=cache, use_cache=True, logits_to_keep=1)
        runtime = TargetRuntime.prepare(ours)
        runtime.start(ctx + max(lengths))
        runtime.forward(ids, last_only=True)
        out = {}
        for n in lengths:
            t_hf, t_rt = [], []
            for r in range(repeats + 1):
                x = torch.randint(100, 1000, (1, n), generator=gen)
                t = time.perf_counter()
                hf(x, cache=cache, use_cache=True)
                t_hf.append(time.perf_counter() - t)
                cache.crop(-n)
                t = time.perf_counter()
                runtime.forward(x)
                t_rt.append(time.perf_counter() - t)
                runtime.crop(ctx)
            out[n] = (1e3 * statistics.median(t_hf[1:]), 1e3 * statistics.median(t_rt[1:]))
    return out


def llama_cpp_decode(gguf: Path, ids, new_tokens: int, threads: int):
    """(decode tok/s, end-to-end tok/s, prefill s) of llama.cpp greedy decoding, or None when
    llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=ids.shape[1] + new_tokens + 8, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    t0 = time.perf_counter()
    t1, n = t0, 0
    for _ in llm.generate(ids[0].tolist(), top_k=1, temp=0.0, repeat_penalty=1.0):  # greedy
        n += 1
        if n == 1:
            t1 = time.perf_counter()          # prefill + first token
        if n == new_tokens:
            break
    t2 = time.perf_counter()
    return {"decode_tokens_per_s": (n - 1) / (t2 - t1),
            "tokens_per_s": n / (t2 - t0), "prefill_s": t1 - t0}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 7168])
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 17])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--decode-context", type=int, default=2048,
                   help="Genesis tokens of the target-only decoding prompt (the main job's)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/verify-cost-cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hf, tokenizer, provenance = load_target()
    ours = copy.deepcopy(hf)
    cfg = hf.config
    params = sum(t.numel() for t in hf.parameters())
    bw, peak = read_bandwidth_gbs(), gemm_peak_gflops()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in tqdm(args.contexts, desc="contexts"):
        ids = tokenizer(kjv_passage(tokenizer, ctx), return_tensors="pt").input_ids[:, :ctx]
        costs = forward_costs(hf, ours, ids, args.lengths, args.repeats, gen)
        for n, (m_hf, m_rt) in costs.items():
            rows.append({"context": ctx, "tokens": n, "hf_ms": round(m_hf, 2),
                         "runtime_ms": round(m_rt, 2),
                         "floor_ms": round(floor_ms(cfg, params, ctx, n, bw, peak), 2)})
    for r in rows:
        one = next(x for x in rows if x["context"] == r["context"] and x["tokens"] == 1)
        r["hf_steps"] = round(r["hf_ms"] / one["hf_ms"], 2)
        r["runtime_steps"] = round(r["runtime_ms"] / one["runtime_ms"], 2)
        r["runtime_over_floor"] = round(r["runtime_ms"] / r["floor_ms"], 2)

    # target-only decoding on the main job's prompt
    text = f"{kjv_passage(tokenizer, args.decode_context)}\n\n{KJV_TASK}"
    ids = torch.tensor([list(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False))])
    decode = {}
    with torch.no_grad():
        hf.generate(ids[:, :64], max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                          do_sample=False)
        t2 = time.perf_counter()
    n = out.shape[1] - ids.shape[1]
    prefill = t1 - t0
    decode["hf_generate"] = {"tokens_per_s": n / (t2 - t1),
                             "decode_tokens_per_s": (n - 1) / (t2 - t1 - prefill),
                             "prefill_s": prefill}
    autoregressive_generate(ours, ids[:, :64], 2)
    res = autoregressive_generate(ours, ids, args.new_tokens)
    decode["sharpdraft_ar"] = {"tokens_per_s": res.tokens_per_s,
                               "decode_tokens_per_s": res.decode_tokens_per_s,
                               "prefill_s": res.prefill_s}
    gguf, _ = default_gguf()
    lc = llama_cpp_decode(gguf, ids, args.new_tokens, args.threads)
    if lc is not None:
        decode["llama_cpp"] = lc
    step_floor = floor_ms(cfg, params, ids.shape[1], 1, bw, peak)

    result = {"threads": args.threads, "repeats": args.repeats, "read_bandwidth_gbs": bw,
              "gemm_peak_gflops": peak, "parameters": params, "target": provenance,
              "runtime": TargetRuntime.prepare(ours).info, "forward": rows,
              "decode_prompt_tokens": ids.shape[1], "new_tokens": args.new_tokens,
              "decode": decode, "decode_step_floor_ms": step_floor}
    lines = [f"Target forward over n tokens after a context, float32, {args.threads} threads, "
             f"median of {args.repeats} interleaved repeats. Floor: max(bytes / {bw:.1f} GB/s "
             f"read bandwidth, FLOPs / {peak:.0f} GFLOP/s GEMM peak), both measured here; bytes "
             f"= {params * 4 / 1e6:.0f} MB of weights + the KV cache.", "",
             "| context | tokens | HF ms | runtime ms | floor ms | HF steps | runtime steps "
             "| runtime / floor |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['tokens']} | {r['hf_ms']} | {r['runtime_ms']} | "
              f"{r['floor_ms']} | {r['hf_steps']} | {r['runtime_steps']} | "
              f"{r['runtime_over_floor']} |" for r in rows]
    lines += ["", f"Target-only greedy decoding, {ids.shape[1]}-token prompt (the main job's), "
              f"{args.new_tokens} new tokens; decode tok/s exclude the prefill. Decode-step "
              f"floor at this context: {step_floor:.1f} ms ({1e3 / step_floor:.0f} tok/s).", "",
              "| decoder | decode tok/s | end-to-end tok/s | prefill s |", "|---|---:|---:|---:|"]
    for name, d in decode.items():
        lines.append(f"| {name} | {d['decode_tokens_per_s']:.1f} | {d['tokens_per_s']:.1f} | "
                     f"{d['prefill_s']:.2f} |")
    if lc is None:
        lines.append("\nllama.cpp: llama-cpp-python not installed (`CMAKE_BUILD_PARALLEL_LEVEL=2 "
                     "pip install llama-cpp-python==0.3.36`, about 10 minutes on 2 cores).")

    fig, axes = figure(1, len(args.contexts), figsize=(4 * len(args.contexts), 3.5),
                       sharey=True, squeeze=False)
    for ax, ctx in zip(axes[0], args.contexts):
        sel = [r for r in rows if r["context"] == ctx]
        xs = [r["tokens"] for r in sel]
        for key, label in (("hf_ms", "HF forward"), ("runtime_ms", "sharpdraft runtime"),
                           ("floor_ms", "floor")):
            ax.plot(xs, [r[key] for r in sel], marker="o", label=label)
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("tokens per forward")
    axes[0][0].set_ylabel("ms per target forward")
    axes[0][0].legend()
    write_report(args.out, "verify_cost", result, lines, figure=fig, dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
