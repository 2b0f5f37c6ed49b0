"""The target runtime on the GGUF's own quantised weights against llama.cpp, on the same file,
prompts and threads (CPU).

1. Decoding (greedy, prefill excluded: tokens after the first / time after the first), on
   held-out tasks (`sharpdraft.data.tasks`: a story, a code request, licence documents of about
   1.4k and 4.5k tokens with a question; none in any corpus): llama.cpp (llama-cpp-python),
   Hugging Face `generate` (float32), our target-only decoding with float32 weights and with
   each quantised form (the file's Q4_1 blocks, Q8_0 and Q4_0 re-quantised at load), and our
   speculative decoding with each shipped drafter on the file's blocks. Rounds interleave every
   configuration on every task; medians. Speedups are against llama.cpp's decode.
2. Target forward milliseconds (`TargetRuntime`, float32 and the file's blocks) over 1-32 rows
   on top of 1k / 4k / 7k-token contexts, next to the floor of reading the weights at the
   measured read bandwidth.
3. Quality on held-out text (Apache-2.0's licence, teacher-forced, in step-sized chunks so the
   quantised kernel runs): greedy (argmax) agreement with the float32 model and with llama.cpp's
   own logits on the same file, and perplexity of each.

llama-cpp-python is built when absent with --build-llama-cpp (about 10 minutes on 2 cores).
Nothing else should run meanwhile.

    python benchmarks/quant_cpu.py --threads 2 --out benchmarks/results/quant-cpu

Writes quant_cpu.json, quant_cpu.md and quant_cpu.png to --out.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import sharpdraft_ext as ext
from sharpdraft.data.prompts import render
from sharpdraft.data.tasks import LICENCES, user_tasks
from sharpdraft.drafters.loading import load_drafter
from sharpdraft.eval.report import figure, write_report
from sharpdraft.inference.engine import autoregressive_generate, speculative_generate
from sharpdraft.target.kv_cache import CACHE_KWARG
from sharpdraft.target.loading import default_gguf, load_target
from sharpdraft.target.quantized import QuantLinear
from sharpdraft.target.runtime import TargetRuntime
from sharpdraft_ext import cpu_runtime

QUANTISED = ("gguf", "q8_0", "q4_0")
DRAFTERS = ("eagle3", "dflash", "pard")


def llama_cpp(build: bool):
    try:
        from llama_cpp import Llama
        return Llama
    except ImportError:
        if not build:
            return None
    print("building llama-cpp-python 0.3.36 (about 10 minutes on 2 cores)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "llama-cpp-python==0.3.36"],
                   check=True, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    from llama_cpp import Llama
    return Llama


def tasks(tokenizer):
    """[(name, prompt ids)]: the user tasks plus a ~4.5k-token document (GPL-2)."""
    out = [(t.name, t.user) for t in user_tasks()]
    out.append(("document 4.5k", user_tasks("GPL-2")[2].user))
    return [(name, render(tokenizer, [{"role": "user", "content": text}])) for name, text in out]


def without_extra_buffers():
    """Make llama-cpp-python load models with ggml's extra buffer types off (weight repacking
    and the AMX matmul): its high-level `Llama` exposes no such switch, so the default model
    parameters it starts from are wrapped. In 0.3.36 the AMX matmul crashes (SIGSEGV in
    ggml_backend_amx_mul_mat) on this model on CPUs with AMX."""
    import llama_cpp
    import llama_cpp.llama as high_level
    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    high_level.llama_cpp.llama_model_default_params = params


def llama_run(llm, new_tokens: int):
    def run(ids):
        llm.reset()
        t0 = time.perf_counter()
        t1, n = t0, 0
        for _ in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n == 1:
                t1 = time.perf_counter()
            if n == new_tokens:
                break
        t2 = time.perf_counter()
        return {"decode": (n - 1) / (t2 - t1), "prefill_s": t1 - t0, "tau": 1.0}
    return run


def hf_run(model, new_tokens: int):
    """HF generate: decode = (new_tokens - 1) / (t(new_tokens) - t(1))."""
    def run(ids):
        x = torch.tensor([ids])
        times = []
        for n in (1, new_tokens):
            t = time.perf_counter()
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            times.append(time.perf_counter() - t)
        return {"decode": (new_tokens - 1) / (times[1] - times[0]), "prefill_s": times[0],
                "tau": 1.0}
    return run


def ours_run(target, drafter, new_tokens: int):
    def run(ids):
        x = torch.tensor([ids])
        r = (autoregressive_generate(target, x, new_tokens) if drafter is None
             else speculative_generate(target, drafter, x, new_tokens))
        return {"decode": r.decode_tokens_per_s, "prefill_s": r.prefill_s,
                "tau": r.tau if drafter is not None else 1.0, "tokens": list(r.tokens)}
    return run


def forward_ms(model, ids, contexts, rows, repeats):
    """{context: {rows: median ms of a forward over `rows` tokens after `context` tokens}}."""
    rt = TargetRuntime.prepare(model)
    out = {}
    for c in contexts:
        rt.start(c + max(rows) + 1)
        rt.forward(torch.tensor([ids[:c]]), last_only=True)
        out[c] = {}
        for m in rows:
            step = torch.tensor([ids[c:c + m]])
            ts = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                rt.forward(step)
                ts.append(time.perf_counter() - t)
                rt.crop(c)
            out[c][m] = round(1e3 * statistics.median(ts[1:]), 2)
    return out


def teacher_forced_logits(model, ids, chunk: int = 64):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        parts = [model(input_ids=ids[:, i:i + chunk], **{CACHE_KWARG: cache}, use_cache=True)
                 .logits[0] for i in range(0, ids.shape[1], chunk)]
    return torch.cat(parts).float()


def weight_bytes(model) -> int:
    """Bytes a forward reads for its linear weights (the LM head included): the packed blocks of
    quantised layers, the float weights of the others."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += mod.packed.numel()
        elif isinstance(mod, torch.nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def read_bandwidth_gbs(repeats: int = 5) -> float:
    x = torch.ones(1 << 27)
    x.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality-tokens", type=int, default=512)
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "forward", "quality", "spec"])
    p.add_argument("--build-llama-cpp", action="store_true")
    p.add_argument("--llama-extra-buffers", choices=["on", "off"], default="on",
                   help="llama.cpp's extra buffer types (weight repacking, the AMX matmul); "
                        "off where its AMX matmul crashes (CPUs with AMX, llama-cpp-python "
                        "0.3.36)")
    p.add_argument("--out", default="benchmarks/results/quant-cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gguf, _ = default_gguf()
    Llama = llama_cpp(args.build_llama_cpp)
    if Llama is not None and args.llama_extra_buffers == "off":
        without_extra_buffers()

    dense, tokenizer, _ = load_target()
    models = {"float32": dense}
    loads = {}
    for w in QUANTISED:
        t = time.perf_counter()
        models[w], _, info = load_target(weights=w)
        loads[w] = {"seconds": round(time.perf_counter() - t, 2),
                    "quantised_linears": info.get("quantised_linears")}
    prompts = tasks(tokenizer)
    n = args.new_tokens

    configs = {}
    llm = None
    if Llama is not None:
        llm = Llama(model_path=str(gguf), n_ctx=8192, n_threads=args.threads,
                    n_threads_batch=args.threads, logits_all=True, verbose=False)
        configs["llama.cpp (Q4_1)"] = llama_run(llm, n)
    if "hf" not in args.skip:
        configs["HF generate (float32)"] = hf_run(copy.deepcopy(dense), n)
    for w, model in models.items():
        label = {"gguf": "Q4_1 (the file's)", "q8_0": "Q8_0", "q4_0": "Q4_0"}.get(w, w)
        configs[f"sharpdraft target-only, {label}"] = ours_run(model, None, n)
    if "spec" not in args.skip:
        for kind in DRAFTERS:
            configs[f"sharpdraft + {kind}, Q4_1"] = ours_run(
                models["gguf"], load_drafter(kind, models["gguf"]), n)

    for run in configs.values():                     # warm-up (and each runtime's plan)
        run(prompts[1][1])
    samples = {(c, t): [] for c in configs for t, _ in prompts}
    extra = {}
    with tqdm(total=args.rounds * len(configs) * len(prompts), desc="decode") as bar:
        for _ in range(args.rounds):
            for task, ids in prompts:
                for name, run in configs.items():
                    r = run(ids)
                    samples[(name, task)].append(r["decode"])
                    extra[(name, task)] = r
                    bar.update()
    # lossless: speculative output against target-only decoding on the same (quantised) weights
    plain = "sharpdraft target-only, Q4_1 (the file's)"
    decode = []
    for (c, t), v in samples.items():
        row = {"config": c, "task": t, "decode_tokens_per_s": statistics.median(v), "samples": v,
               "prefill_s": extra[(c, t)]["prefill_s"], "tau": extra[(c, t)]["tau"]}
        if c.startswith("sharpdraft +"):
            row["identical_to_target_only"] = extra[(c, t)]["tokens"] == extra[(plain, t)]["tokens"]
        decode.append(row)

    forward = {}
    bw = read_bandwidth_gbs()
    floors = {}
    if "forward" not in args.skip:
        doc = render(tokenizer, [{"role": "user", "content": (LICENCES / "GPL-3").read_text()}])
        for w in ("float32", "gguf"):
            forward[w] = forward_ms(models[w], doc, args.contexts, args.rows, args.repeats)
            nbytes = weight_bytes(models[w])
            floors[w] = {"weight_bytes": nbytes, "floor_ms": round(1e3 * nbytes / (bw * 1e9), 2)}

    quality = {}
    if "quality" not in args.skip:
        text = (LICENCES / "Apache-2.0").read_text()
        ids = torch.tensor([tokenizer(text)["input_ids"][:args.quality_tokens]])
        logits = {w: teacher_forced_logits(m, ids)[:-1] for w, m in models.items()}
        if llm is not None:
            llm.reset()
            llm.eval(ids[0].tolist())
            logits["llama.cpp"] = torch.tensor(llm.scores[:ids.shape[1] - 1]).float()
        nxt = ids[0, 1:]
        for w, lg in logits.items():
            quality[w] = {
                "perplexity": round(float(F.cross_entropy(lg, nxt).exp()), 4),
                "agreement_vs_float32": round(float((lg.argmax(-1) == logits["float32"]
                                                     .argmax(-1)).float().mean()), 4)}
            if "llama.cpp" in logits:
                quality[w]["agreement_vs_llama_cpp"] = round(float(
                    (lg.argmax(-1) == logits["llama.cpp"].argmax(-1)).float().mean()), 4)

    meta = {"new_tokens": n, "rounds": args.rounds, "threads": args.threads,
            "cpu_isa": ext.cpu_isa(), "quant_isa": cpu_runtime.quant_isa(),
            "prompt_tokens": {t: len(i) for t, i in prompts}, "read_bandwidth_gbs": round(bw, 1),
            "loads": loads, "gguf": str(gguf), "llama_extra_buffers": args.llama_extra_buffers}
    names = [t for t, _ in prompts]
    base = "llama.cpp (Q4_1)" if llm is not None else None
    med = {(r["config"], r["task"]): r for r in decode}
    lines = [f"Decode tokens/s (prefill excluded), median of {args.rounds} interleaved rounds, "
             f"{n} new tokens, {args.threads} threads, quantised kernel {meta['quant_isa']}; "
             f"(x) = vs llama.cpp's decode on the same task" + ("" if base else
             " (llama.cpp not installed)") + "; tau for speculative rows."
             + (" llama.cpp ran with its extra buffer types off (--llama-extra-buffers off)."
                if args.llama_extra_buffers == "off" else ""), "",
             "| configuration | " + " | ".join(names) + " | geomean vs llama.cpp |",
             "|---|" + "---|" * (len(names) + 1)]
    for c in configs:
        cells, ratios = [], []
        for t in names:
            r = med[(c, t)]
            cell = f"{r['decode_tokens_per_s']:.1f}"
            if base:
                ratio = r["decode_tokens_per_s"] / med[(base, t)]["decode_tokens_per_s"]
                ratios.append(ratio)
                cell += f" ({ratio:.2f}x)"
            if r["tau"] > 1:
                cell += f" tau {r['tau']:.2f}"
            if r.get("identical_to_target_only") is False:
                cell += " (output differs!)"
            cells.append(cell)
        gm = statistics.geometric_mean(ratios) if ratios else float("nan")
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {gm:.2f}x |")
    if forward:
        lines += ["", f"Target forward ms (`TargetRuntime`) by rows, after a context of c "
                  f"tokens; floor = weight bytes / {bw:.1f} GB/s measured read bandwidth.", "",
                  "| weights | context | " + " | ".join(f"{m} rows" for m in args.rows)
                  + " | verify(8) / step(1) | floor ms |",
                  "|---|---|" + "---|" * (len(args.rows) + 2)]
        for w, by_c in forward.items():
            for c, by_m in by_c.items():
                ratio = by_m.get(8, float("nan")) / by_m[1] if 8 in by_m else float("nan")
                lines.append(f"| {w} | {c} | " + " | ".join(f"{by_m[m]:.1f}" for m in args.rows)
                             + f" | {ratio:.2f} | {floors[w]['floor_ms']:.1f} |")
    if quality:
        lines += ["", f"Quality, teacher-forced on {args.quality_tokens} tokens of "
                  "/usr/share/common-licenses/Apache-2.0 (held out):", "",
                  "| model | perplexity | argmax agreement vs float32 | vs llama.cpp |",
                  "|---|---|---|---|"]
        for w, q in quality.items():
            lines.append(f"| {w} | {q['perplexity']:.3f} | {q['agreement_vs_float32']:.3f} | "
                         f"{q.get('agreement_vs_llama_cpp', float('nan')):.3f} |")
    fig, ax = figure(figsize=(10, 0.45 * len(configs) + 1.5))
    ys = list(range(len(configs)))
    for i, t in enumerate(names):
        ax.barh([y + i * 0.8 / len(names) for y in ys],
                [med[(c, t)]["decode_tokens_per_s"] for c in configs],
                height=0.8 / len(names), label=t)
    ax.set_yticks([y + 0.4 for y in ys], list(configs))
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (prefill excluded)")
    ax.legend()
    ax.set_title(f"Target runtime on quantised weights vs llama.cpp ({args.threads} threads)")
    write_report(args.out, "quant_cpu", {"meta": meta, "decode": decode, "forward_ms": forward,
                                         "floors": floors, "quality": quality},
                 "\n".join(lines) + "\n", figure=fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
