"""Start an EAGLE-3 drafter in the public architecture from a checkpoint trained with the EAGLE 3.1
options (per-feature RMSNorm before `fc`, normalised output fed forward), for a fine-tune.

The public EAGLE-3 (SafeAILab/EAGLE `eagle/model/cnets.py`, SpecForge `llama3_eagle.py`) feeds
the raw target features to `fc` and the layer's un-normalised output to the next draft row. A
per-feature RMSNorm cannot be folded into `fc`, so the public drafter has to be trained; this
script gives that training a close start: each feature's RMSNorm(x * s) * w is replaced by the
linear map x * s * w / r, r the mean row RMS of that feature's x * s over `--texts` corpus
sequences, stored in `feature_scale` (a per-channel scale, folded into `fc` on export).

    python scripts/eagle3_public_init.py --from python/sharpdraft/checkpoints/eagle3-smollm2 \
        --out runs/eagle3-public-init
    sharpdraft train eagle3 --init-from runs/eagle3-public-init ...
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch

from sharpdraft import load_target
from sharpdraft.drafters.eagle3 import Eagle3Drafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", required=True, help="EAGLE-3 checkpoint folder")
    p.add_argument("--out", required=True, help="folder written (config.json, model.safetensors)")
    p.add_argument("--corpus", default="corpus/train", help="corpus shards (training text)")
    p.add_argument("--texts", type=int, default=32, help="sequences measured")
    args = p.parse_args()

    target, _, _ = load_target()
    old = Eagle3Drafter.load(args.source, target=target).float()
    cfg = old.config
    if not cfg.norm_features:
        raise SystemExit(f"--from {args.source}: already without feature norms")
    rows = []
    for shard in sorted(Path(args.corpus).glob("*.npz")):
        with np.load(shard) as z:
            ids, offsets = z["tokens"], z["offsets"]
        for start, end in zip(offsets[:-1], offsets[1:]):
            rows.append(torch.as_tensor(ids[start:end], dtype=torch.long))
            if len(rows) >= args.texts:
                break
        if len(rows) >= args.texts:
            break
    ht = cfg.target_hidden_size
    rms = torch.zeros(len(cfg.target_layer_ids))
    with torch.no_grad():
        for seq in rows:
            hs = target(seq[None], output_hidden_states=True).hidden_states
            x = old.context_features(hs)[0, 1:] * old.feature_scale   # position 0 left out
            rms += torch.stack([part.pow(2).mean(-1).sqrt().mean()
                                for part in x.split(ht, dim=-1)])
    rms /= len(rows)
    weights = torch.cat([n.weight.float() / r for n, r in zip(old.feature_norms, rms)])
    new = Eagle3Drafter(dataclasses.replace(cfg, norm_features=False, feed_normed_output=False))
    state = {k: v for k, v in old.state_dict().items() if not k.startswith("feature_norms.")}
    state["feature_scale"] = old.feature_scale * weights
    new.load_state_dict(state)
    new.to(torch.bfloat16).save(args.out)
    print(f"wrote {args.out}: feature RMS {[round(float(r), 3) for r in rms]}")


if __name__ == "__main__":
    main()
