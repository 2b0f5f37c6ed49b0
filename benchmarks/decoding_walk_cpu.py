"""The training recipes' held-out tau against real decoding, on the same text.

The recipes of EAGLE-3 and PARD pick their best checkpoint by tau_proxy, the mean over every
response row of 1 + the drafts that would be accepted by a step starting there. Real decoding
starts a step only where the previous one stopped, usually just after a rejected draft, and on
the held-out bench its tau has stayed well below the proxy (EAGLE-3 stage 8: 1.99 against 2.43).
This script measures where the gap comes from. For every prompt it decodes greedily with the
drafter (chain drafting, frozen) and records real tau; then it runs the target once over prompt
+ that output, builds the same per-row features a training cache holds, and calls the recipe's
own `evaluate` on it, which reports tau_proxy (every row) and tau_walk (the walk decoding takes,
`training.losses.decoding_walk`). tau_walk should equal real tau up to the last few tokens
(the recipe drops rows too close to the end for every draft; the engine caps its last step) and
near-ties between the incremental and the full forward; tau_proxy - tau_walk is the part of the
gap that the choice of starting rows explains, on identical text.

Prompts: --corpus-prompts first-turn prompts of the corpus's held-out split (never trained on),
as `sharpdraft bench` picks them. Writes decoding_walk.json and decoding_walk.md to --out.

    python benchmarks/decoding_walk_cpu.py --corpus corpus --corpus-prompts 8 \\
        --out benchmarks/results/decoding-walk-cpu
"""
import argparse
import statistics

import torch
from tqdm import tqdm

from sharpdraft import training
import sharpdraft
from sharpdraft.drafters import registry
from sharpdraft.eval.bench import corpus_prompts, decode
from sharpdraft.eval.report import write_report
from sharpdraft.training.cache import compute_features, trained_rows

# the kinds whose recipe reports the decoding walk (`Recipe.walk_evaluate`)
WALKED = [n for n in registry.names() if registry.get(n).trainable
          and training.recipe(n).RECIPE.walk_evaluate is not None]


def sequence(target, ids: torch.Tensor, new_tokens, layer_ids) -> dict:
    """A held-out cache entry for prompt ids (1, P) + the drafter's output: the target's
    features of `layer_ids`, its top-32 next tokens, response rows trained."""
    seq = torch.cat([ids[0], torch.tensor(new_tokens, dtype=ids.dtype)])
    feats, top_p, top_i = compute_features(target, seq[None], layer_ids, 32)
    mask = [False] * ids.shape[1] + [True] * len(new_tokens)
    return {"ids": seq, "feats": feats[0], "top_p": top_p[0], "top_i": top_i[0],
            "trained": torch.from_numpy(trained_rows(mask))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafters", nargs="+", default=WALKED, choices=WALKED)
    p.add_argument("--corpus", default="corpus")
    p.add_argument("--corpus-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/decoding-walk-cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = None
    rows, summary = [], {}
    for name in args.drafters:
        # float32, the shipped checkpoint, frozen: no SharpDraft
        target, tokenizer, provenance = sharpdraft.load_target(dtype="float32")
        drafter = sharpdraft.load_drafter(name, target, sharp=False)
        prompts = prompts or corpus_prompts(args.corpus, args.corpus_prompts)
        # the target layers the drafter reads (PARD reads none: one is computed, unused)
        layers = list(getattr(drafter.config, "target_layer_ids", [0]))
        walk_evaluate = training.recipe_of(drafter).walk_evaluate
        for pr in tqdm(prompts, desc=name, unit="prompt"):
            res = decode(target, drafter, pr["ids"], args.max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id)
            seq = sequence(target, pr["ids"], res.tokens, layers)
            ev = walk_evaluate(drafter, target, [seq], window=seq["ids"].shape[0])
            rows.append({"drafter": name, "prompt": pr["name"], "new_tokens": len(res.tokens),
                         "real_tau": res.tau, "tau_walk": ev["tau_walk"],
                         "tau_proxy": ev["tau_proxy"], "steps": len(res.accept_lengths)})
        mine = [r for r in rows if r["drafter"] == name]
        summary[name] = {k: statistics.fmean(r[k] for r in mine)
                         for k in ("real_tau", "tau_walk", "tau_proxy")}
        summary[name]["max_abs_walk_minus_real"] = max(abs(r["real_tau"] - r["tau_walk"])
                                                       for r in mine)
    meta = {"max_new_tokens": args.max_new_tokens, "threads": args.threads, "dtype": "float32",
            "prompts": [pr["name"] for pr in prompts], "target": provenance}
    lines = [f"Shipped drafters, chain drafting, frozen, greedy, {args.max_new_tokens} new tokens, "
             f"float32, on {len(prompts)} held-out corpus prompts. real: the engine's tau; walk "
             "and proxy: the training recipe's `evaluate` on prompt + that output.", "",
             "| drafter | real tau | tau_walk | tau_proxy | largest per-prompt abs(walk - real) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['real_tau']:.3f} | {v['tau_walk']:.3f} | {v['tau_proxy']:.3f} | "
              f"{v['max_abs_walk_minus_real']:.3f} |" for k, v in summary.items()]
    lines += ["", "| drafter | prompt | new tokens | steps | real tau | tau_walk | tau_proxy |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['drafter']} | {r['prompt']} | {r['new_tokens']} | {r['steps']} | "
              f"{r['real_tau']:.3f} | {r['tau_walk']:.3f} | {r['tau_proxy']:.3f} |" for r in rows]
    write_report(args.out, "decoding_walk", {"meta": meta, "summary": summary, "rows": rows},
                 lines, default=str)
    print("\n".join(lines[:6]))


if __name__ == "__main__":
    main()
