"""Where greedy speculative decoding leaves target-only decoding in a given --dtype (CPU).

For each of the first 8 held-out corpus prompts: 128 new tokens of target-only greedy decoding
and of EAGLE-3 chain speculative decoding (the shipped checkpoint, SharpDraft at its defaults),
both in the target dtype `--dtype` picks; at the first position where they differ, the logits
of one float32 forward of the same weights (bfloat16-rounded when bfloat16 was picked, so only
the arithmetic differs) after the common prefix, the two tokens and the logit gap between them. A gap far below the dtype's resolution is a rounding tie (the
verification forward over several rows rounds differently from the one-row decode step), not a
wrong acceptance.

    python benchmarks/bf16_divergence_cpu.py --dtype auto | tee benchmarks/results/bf16-divergence-cpu/auto.txt
"""
import argparse

import torch

import sharpdraft
from sharpdraft.eval.bench import corpus_prompts, decode
from sharpdraft.inference.engine import autoregressive_generate

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
target, tok, prov = sharpdraft.load_target(dtype=a.dtype)
drafter = sharpdraft.load_drafter("eagle3", target)          # shipped, SharpDraft as the CLI
dtype = next(target.parameters()).dtype
print(f"target dtype {dtype}")
for p in corpus_prompts("corpus", a.prompts):
    ar = autoregressive_generate(target, p["ids"], a.max_new_tokens, eos_token_id=tok.eos_token_id)
    res = decode(target, drafter, p["ids"], a.max_new_tokens, tree=False,
                 eos_token_id=tok.eos_token_id)
    x, y = ar.tokens, res.tokens
    i = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), None)
    if i is None:
        print(p["name"], "identical", len(x), len(y))
        continue
    seq = torch.cat([p["ids"], torch.tensor([x[:i]], dtype=p["ids"].dtype)], 1)
    with torch.no_grad():
        lg = target.float()(seq).logits[0, -1]
    target.to(dtype)
    top = lg.topk(2)
    print(p["name"], "first divergence at", i, "of", len(x), "ar", x[i], "spec", y[i],
          "fp32 top2", top.indices.tolist(), "gap %.4f" % float(top.values[0] - top.values[1]),
          "fp32 logit ar-spec %.4f" % float(lg[x[i]] - lg[y[i]]), flush=True)
