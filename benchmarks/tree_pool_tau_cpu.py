"""Held-out tree acceptance length tau of the shipped EAGLE-3 drafter for tree shapes
(topk x depth x tokens), on the 8 held-out corpus prompts of the stage benches, 128 new tokens,
float32, frozen; tau here is the mean of each prompt's committed tokens per verification step.
Every output is checked token-identical to target-only decoding. Deterministic (no timing).

    python benchmarks/tree_pool_tau_cpu.py 4x5x16 4x6x16 8x6x32
Run with PYTHONPATH=<older checkout>/python to measure an earlier tree builder.
"""
import sys, json, torch, numpy as np, sharpdraft
torch.set_num_threads(1)
from sharpdraft.models import load_target
from sharpdraft.drafters.eagle3 import Eagle3Drafter
from sharpdraft.bench import corpus_prompts
from sharpdraft.engine import tree_speculative_generate, autoregressive_generate
out = load_target(); target = out[0]
path = "python/sharpdraft/checkpoints/eagle3-smollm2"
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1:]] or [(4, 5, 16)]
prompts = corpus_prompts("corpus", 8)
refs = [autoregressive_generate(target, p["ids"], 128).tokens for p in prompts]
print(sharpdraft.__file__)
for k, dep, n in shapes:
    dr = Eagle3Drafter.load(path, target=target).float().eval()
    dr.config.tree_topk, dr.config.tree_depth, dr.config.tree_tokens = k, dep, n
    taus = []
    for p, ref in zip(prompts, refs):
        r = tree_speculative_generate(target, dr, p["ids"], 128)
        assert r.tokens == ref
        taus.append(sum(r.accept_lengths) / len(r.accept_lengths))
    print(f"{k}x{dep}x{n}", round(float(np.mean(taus)), 3), [round(t, 2) for t in taus], flush=True)
