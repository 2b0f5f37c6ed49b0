"""SharpDraft's premise in real decoding: speculative decoding tau at contexts from 1x to 32x a
drafter's training window, frozen against SharpDraft's scalings, on held-out documents.

Prompts: a document and a question. The document is the first c tokens of a stream of licence
texts from /usr/share/common-licenses (held out from every corpus and training run; two streams,
GPL-3 + GPL-2 and GFDL-1.3 + LGPL-2.1 + MPL-2.0, so each context has two prompts), for each
context c of --contexts. Each drafter of --drafter NAME=PATH decodes every prompt greedily under
each scaling of --scalings (frozen always; "calibrated" where the checkpoint has per-layer
slopes). Greedy speculative decoding is lossless, so every scaling commits the same tokens
(checked) and only the drafts differ: tau is the mean number of tokens committed per
verification step, with a 95% bootstrap interval over the steps of both prompts, and the
difference from frozen with an interval from resampling both sides.

    python benchmarks/premise_cpu.py --drafter shipped=dflash w256=runs/premise/dflash-w256 \
        --out benchmarks/results/premise-cpu/decode
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import sharpdraft
from sharpdraft.attention import SharpConfig
from sharpdraft.data.prompts import render
from sharpdraft.data.tasks import LICENCES
from sharpdraft.eval.long_decode import bootstrap_diff
from sharpdraft.eval.report import figure, save_figure, write_report
from sharpdraft.eval.sweep import bootstrap_ci
from sharpdraft.inference.engine import speculative_generate

STREAMS = (("GPL-3", "GPL-2"), ("GFDL-1.3", "LGPL-2.1", "MPL-2.0"))
QUESTION = "Summarise the conditions this text sets, in a few sentences."


def documents(tokenizer, contexts):
    """[(context, stream index, prompt ids)]: the first c tokens of each licence stream, then
    the question, in the chat template."""
    out = []
    for s, names in enumerate(STREAMS):
        text = "\n\n".join((LICENCES / n).read_text() for n in names)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for c in contexts:
            if c > len(ids):
                raise ValueError(f"--contexts: {c} tokens is more than the {len(ids)} of the "
                                 f"stream {'+'.join(names)}")
            doc = tokenizer.decode(ids[:c])
            out.append((c, s, torch.tensor([render(tokenizer, [
                {"role": "user", "content": f"{doc}\n\n{QUESTION}"}])])))
    return out


def scaling_configs(drafter, names):
    """{name: SharpConfig} for the drafter: frozen, "slope S", "calibrated" (when the
    checkpoint has per-layer slopes), at the drafter's own n_ref."""
    n_ref = drafter.sharp.n_ref
    out = {"frozen": SharpConfig(mode="none", n_ref=n_ref)}
    for name in names:
        if name.startswith("slope "):
            out[name] = SharpConfig(mode="fixed_slope", slope=float(name.split()[1]), n_ref=n_ref)
        elif name == "calibrated":
            slopes = getattr(drafter.config, "sharp_slopes", None)
            if slopes:
                out[name] = SharpConfig(mode="fixed_slope", n_ref=n_ref, layer_slopes=slopes)
        elif name != "frozen":
            raise ValueError(f"--scalings: unknown {name!r} (frozen, 'slope S', calibrated)")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", nargs="+", required=True, metavar="NAME=PATH",
                   help="drafters to compare: a label and a checkpoint folder or shipped kind")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 7680])
    p.add_argument("--scalings", nargs="+", default=["slope 0.2", "slope 0.4", "calibrated"])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/premise-cpu/decode")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    labels = dict(d.split("=", 1) for d in args.drafter)
    target, tokenizer, info = sharpdraft.load_target()
    drafters = {k: sharpdraft.load_drafter(v, target, sharp=False) for k, v in labels.items()}
    prompts = documents(tokenizer, args.contexts)
    suites = {k: scaling_configs(d, args.scalings) for k, d in drafters.items()}
    steps, texts, rows = {}, {}, []
    bar = tqdm(total=len(prompts) * sum(len(s) for s in suites.values()), desc="premise decode")
    t0 = time.perf_counter()
    for c, s, ids in prompts:
        for label, drafter in drafters.items():
            for name, sc in suites[label].items():
                drafter.sharp = sc
                res = speculative_generate(target, drafter, ids, args.max_new_tokens,
                                           eos_token_id=tokenizer.eos_token_id)
                steps.setdefault((label, c, name), []).extend(res.accept_lengths)
                texts.setdefault((c, s), set()).add(tuple(res.tokens))
                bar.update(1)
    bar.close()
    for label in drafters:
        for c in args.contexts:
            base = torch.tensor(steps[(label, c, "frozen")], dtype=torch.float64)
            for name in suites[label]:
                x = torch.tensor(steps[(label, c, name)], dtype=torch.float64)
                m, lo, hi = bootstrap_ci(x)
                d, dlo, dhi = bootstrap_diff(x, base)
                rows.append({"drafter": label, "n_ref": drafters[label].sharp.n_ref,
                             "context": c, "ratio": round(c / drafters[label].sharp.n_ref, 2),
                             "scaling": name, "steps": len(x), "tau": round(m, 4),
                             "ci95": [round(lo, 4), round(hi, 4)],
                             "delta_vs_frozen": round(d, 4),
                             "delta_ci95": [round(dlo, 4), round(dhi, 4)],
                             "relative_delta": round(d / float(base.mean()), 4)})
    meta = {"drafters": labels, "contexts": args.contexts, "max_new_tokens": args.max_new_tokens,
            "threads": args.threads, "target": info, "streams": ["+".join(n) for n in STREAMS],
            "question": QUESTION, "seconds": round(time.perf_counter() - t0, 1),
            "same_text_under_every_scaling": all(len(v) == 1 for v in texts.values())}
    lines = [f"Speculative decoding tau on held-out licence documents (two per context, "
             f"{args.max_new_tokens} new tokens, greedy), frozen vs SharpDraft at each drafter's "
             f"n_ref. Same text under every scaling: {meta['same_text_under_every_scaling']}. "
             f"Cell: tau [95% bootstrap over steps]; delta vs frozen [95%], relative.", "",
             "| drafter | n_ref | context | x n_ref | scaling | tau | delta vs frozen | relative |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['n_ref']} | {r['context']} | {r['ratio']:g} | "
                     f"{r['scaling']} | {r['tau']:.3f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
                     f" | {r['delta_vs_frozen']:+.3f} [{r['delta_ci95'][0]:+.2f}, "
                     f"{r['delta_ci95'][1]:+.2f}] | {100 * r['relative_delta']:+.1f}% |")
    out = Path(args.out)
    write_report(out, "premise_decode", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    fig, axes = figure(1, len(drafters), figsize=(5.5 * len(drafters), 4))
    axes = axes if len(drafters) > 1 else [axes]
    for ax, label in zip(axes, drafters):
        for name in suites[label]:
            rs = [r for r in rows if r["drafter"] == label and r["scaling"] == name]
            ax.errorbar([r["ratio"] for r in rs], [r["tau"] for r in rs],
                        yerr=[[r["tau"] - r["ci95"][0] for r in rs],
                              [r["ci95"][1] - r["tau"] for r in rs]],
                        marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context / n_ref")
        ax.set_ylabel("tau")
        ax.set_title(f"{label} (n_ref {drafters[label].sharp.n_ref})")
        ax.legend(fontsize=8)
    save_figure(fig, out / "premise_decode.png")
    print("\n".join(lines))
    print(json.dumps({"out": str(out), "seconds": meta["seconds"]}))


if __name__ == "__main__":
    main()
