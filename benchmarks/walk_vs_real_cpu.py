"""Teacher-forced decoding walk (training.losses.decoding_walk) over the target's own greedy output
vs real chain speculative decoding of the shipped EAGLE-3 drafter, on the same 8 held-out corpus
prompts (128 new tokens, float32): whether inference matches training's measure.

    python benchmarks/walk_vs_real_cpu.py [DRAFTER_FOLDER]
"""
# teacher-forced walk on the target's own greedy output vs real chain decoding, same prompts
import sys, torch, numpy as np
torch.set_num_threads(1)
from sharpdraft.models import load_target
from sharpdraft.drafters.eagle3 import Eagle3Drafter
from sharpdraft.bench import corpus_prompts
from sharpdraft.engine import autoregressive_generate, speculative_generate
from sharpdraft.training.cache import compute_features, trained_rows
from sharpdraft.training.eagle3 import depth_losses, fused_columns
from sharpdraft.training.losses import decoding_walk, target_to_draft
from sharpdraft.drafters.dflash import evenly_spaced_layers
out = load_target(); target, tok = out[0], out[1]
path = sys.argv[1] if len(sys.argv) > 1 else "python/sharpdraft/checkpoints/eagle3-smollm2"
dr = Eagle3Drafter.load(path, target=target).float().eval()
L = len(target.get_decoder().layers)
chosen = list(dr.config.target_layer_ids)
K = dr.config.chain_length
cols = fused_columns(chosen, chosen, target.config.hidden_size)
real, walk = [], []
for p in corpus_prompts("corpus", 8):
    ids = p["ids"]
    ar = autoregressive_generate(target, ids, 128)
    sp = speculative_generate(target, dr, ids, 128)
    assert sp.tokens == ar.tokens
    full = torch.cat([ids, torch.tensor([ar.tokens])], 1)
    with torch.no_grad():
        f, tp, ti = compute_features(target, full, chosen, 32)
    mask = np.zeros(full.shape[1], bool); mask[ids.shape[1]:] = True
    seq = {"ids": full[0], "feats": f[0], "top_p": tp[0], "top_i": ti[0],
           "trained": torch.from_numpy(trained_rows(mask))}
    # the target's top-1 must equal the greedy text
    with torch.no_grad():
        per = depth_losses(dr, target, seq, 0, full.shape[1], K, cols, target_to_draft(dr.d2t, target.get_output_embeddings().weight.shape[0]))
    oks = []
    for d, (_, v, lg, top1) in enumerate(per):
        g = lg.argmax(-1) if dr.d2t is None else dr.d2t[lg.argmax(-1)]
        oks.append((g == top1) & v)
    n = oks[-1].shape[0]
    start = per[0][1][:n]
    runs = torch.stack([o[:n] for o in oks], 1).int().cumprod(1).sum(1).float()
    w = decoding_walk(runs, start)
    tau_real = sum(sp.accept_lengths) / len(sp.accept_lengths)
    real.append(tau_real); walk.append(float(w.mean()))
    print(f"{p['name'][:30]:30s} real {tau_real:.3f} walk {float(w.mean()):.3f} steps {len(sp.accept_lengths)} vs {len(w)}  proxy {1+float(runs[start].mean()):.3f}", flush=True)
print("mean real", np.mean(real), "walk", np.mean(walk))
