"""vLLM (CPU build) with and without the sharpdraft plugin, beside the project's own engine.

Decodes the held-out user tasks (`sharpdraft.data.tasks`: a story, a code request, a 1.4k-token
licence text with a question) greedily on the default SmolLM2 target: vLLM target-only, vLLM
with each shipped drafter exported to its public layout (frozen: plugin mode none; SharpDraft:
mode fixed_slope), and the project's engine with the same drafters. Every engine lives in this
process for the whole run; rounds interleave every configuration on every task; medians.
End-to-end tokens/s (new tokens / wall time, prefill included) and tau (vLLM: 1 + accepted /
drafts from its own counters, read from an engine of its own per drafter before the timed
engines are built: vLLM's metrics registry follows the engine built last).

Run in the vLLM environment (scripts/vllm_test.sh creates it), nothing else running:
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_cpu.py --rounds 3
Writes benchmarks/results/vllm/vllm_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # engines in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import sharpdraft_ext as ext  # noqa: E402

from sharpdraft import generate, load_drafter, load_target  # noqa: E402
from sharpdraft.data.prompts import render  # noqa: E402
from sharpdraft.data.tasks import user_tasks  # noqa: E402
from sharpdraft.drafters.export import export_drafter  # noqa: E402
from sharpdraft.integrations import vllm as plugin  # noqa: E402
from sharpdraft.target.loading import resolve_target  # noqa: E402

KINDS = ("eagle3", "dflash", "pard")
METHODS = {"eagle3": ("eagle3", {}), "dflash": ("dflash", {}),
           "pard": ("draft_model", {"parallel_drafting": True})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/vllm")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    folder, _ = resolve_target()
    target, tokenizer, _ = load_target(dtype=torch.float32)
    tasks = user_tasks()
    prompts = [render(tokenizer, [{"role": "user", "content": t.user}]) for t in tasks]
    public = Path(tempfile.mkdtemp(prefix="sharpdraft-vllm-"))

    def make_llm(spec=None):
        return LLM(model=str(folder), dtype="float32", max_model_len=args.max_model_len, seed=0,
                   enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False,
                   speculative_config=spec)

    configs = {}                 # name -> callable(prompt ids) -> (new tokens, seconds, tau)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)

    def counters(llm):
        v = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        return (v.get("vllm:spec_decode_num_drafts", 0),
                v.get("vllm:spec_decode_num_accepted_tokens", 0))

    def vllm_run(llm, scales=(), mode=None, tau=None):
        """A timed request; tau comes from `tau` (the isolated pass below): vLLM's metrics
        registry follows the engine built last, so the counters of the engines built before it
        stop moving."""
        def run(ids):
            for s in scales:
                s.mode = mode
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            return len(out[0].outputs[0].token_ids), wall, (tau or {}).get(tuple(ids), 1.0)
        return run

    def spec_engine(spec):
        """An engine drafting with `spec`, the plugin hooked into it (mode set per request)."""
        before = len(plugin.hooked_layers())
        os.environ[plugin.ENV_MODE] = "fixed_slope"
        plugin.register()
        llm = make_llm(spec)
        del os.environ[plugin.ENV_MODE]
        plugin.register()
        return llm, plugin.hooked_layers()[before:]

    def isolated_taus(spec):
        """{mode: {prompt ids: tau}} from an engine of its own, read while it is the newest
        (1 + accepted / drafts from vLLM's counters), then shut down. Greedy decoding is
        deterministic, so the timed engine's requests draft the same."""
        llm, scales = spec_engine(spec)
        taus = {}
        for mode in ("none", "fixed_slope"):
            for s in scales:
                s.mode = mode
            taus[mode] = {}
            for ids in prompts:
                d0, a0 = counters(llm)
                llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                d1, a1 = counters(llm)
                taus[mode][tuple(ids)] = 1 + (a1 - a0) / (d1 - d0) if d1 > d0 else 1.0
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        return taus

    def ours_run(drafter):
        def run(ids):
            r = generate(target, drafter, torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id)
            return r.new_tokens, r.wall_s, r.tau
        return run

    configs["vLLM target-only"] = vllm_run(make_llm())
    configs["sharpdraft target-only"] = ours_run(None)
    for kind in KINDS:
        ours = load_drafter(kind, target, sharp=False)
        export_drafter(ours, target, public / kind, tokenizer=tokenizer, dtype=torch.float32)
        frozen = load_drafter(public / kind, target, sharp=False)
        method, extra = METHODS[kind]
        spec = dict(method=method, model=str(public / kind),
                    num_speculative_tokens=frozen.max_drafts, **extra)
        taus = isolated_taus(spec)
        llm, scales = spec_engine(spec)
        configs[f"vLLM + {kind}, frozen"] = vllm_run(llm, scales, "none", taus["none"])
        configs[f"vLLM + {kind}, SharpDraft"] = vllm_run(llm, scales, "fixed_slope",
                                                        taus["fixed_slope"])
        configs[f"sharpdraft + {kind}, frozen"] = ours_run(frozen)
        configs[f"sharpdraft + {kind}, SharpDraft"] = ours_run(
            load_drafter(public / kind, target, sharp=True))

    for run in configs.values():                                   # warm-up
        run(prompts[0][:64])
    samples = {(c, t.name): [] for c in configs for t in tasks}
    taus = {}
    with tqdm(total=args.rounds * len(configs) * len(tasks), desc="vLLM bench") as bar:
        for _ in range(args.rounds):
            for task, ids in zip(tasks, prompts):
                for name, run in configs.items():
                    n, wall, tau = run(ids)
                    samples[(name, task.name)].append(n / wall)
                    taus[(name, task.name)] = tau
                    bar.update()

    rows = [{"config": c, "task": t, "tokens_per_s": statistics.median(v),
             "samples": v, "tau": taus[(c, t)]} for (c, t), v in samples.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": {t.name: len(p) for t, p in zip(tasks, prompts)},
            "cpu": ext.cpu_isa(), "threads": torch.get_num_threads()}
    tmp = out / "vllm_cpu.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.rename(out / "vllm_cpu.json")
    names = [t.name for t in tasks]
    lines = ["| configuration | " + " | ".join(f"{n} tok/s (tau)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for c in configs:
        cells = [f"{statistics.median(samples[(c, n)]):.1f} ({taus[(c, n)]:.2f})"
                 for n in names]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "vllm_cpu.md").write_text(text)
    print(json.dumps(meta))
    print(text)


if __name__ == "__main__":
    main()
