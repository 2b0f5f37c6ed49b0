"""Start a drafter in the public architecture of its format from a checkpoint trained without
it, for a fine-tune (the shipped drafters moved to the public architectures this way).

EAGLE-3 (`--drafter eagle3`): the public drafter (SafeAILab/EAGLE `eagle/model/cnets.py`,
SpecForge `llama3_eagle.py`) feeds raw target features to `fc` and the layer's un-normalised
output to the next row, where ours had the EAGLE 3.1 options (a per-feature RMSNorm before
`fc`, the normalised output fed forward). A per-row normalisation cannot be folded into a
weight, so each feature's RMSNorm(x * s) * w becomes the linear x * s * w / r (r: the mean row
RMS of that feature's x * s over the measured sequences), kept in `feature_scale`.

DFlash (`--drafter dflash`): public DFlash layers (z-lab/dflash `dflash/model.py`) RMSNorm each
head's queries and keys, and draft over the target's whole vocabulary. The new q/k norms start
at weight r (the mean per-head RMS of that layer's queries / keys), so that the scores keep
their typical scale; the draft vocabulary is dropped (the target's LM head is used whole).

    python scripts/public_architecture_init.py --drafter eagle3 \
        --from python/sharpdraft/checkpoints/eagle3-smollm2 --out runs/eagle3-public-init
    sharpdraft train eagle3 --init-from runs/eagle3-public-init ...
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch

from sharpdraft import load_target
from sharpdraft.drafters.dflash import DFlashDrafter
from sharpdraft.drafters.eagle3 import Eagle3Drafter


def corpus_sequences(folder: str, count: int) -> list:
    """The first `count` token sequences of the corpus shards in `folder` (training text)."""
    rows = []
    for shard in sorted(Path(folder).glob("*.npz")):
        with np.load(shard) as z:
            ids, offsets = z["tokens"], z["offsets"]
        for start, end in zip(offsets[:-1], offsets[1:]):
            rows.append(torch.as_tensor(ids[start:end], dtype=torch.long))
            if len(rows) == count:
                return rows
    return rows


def eagle3(old: Eagle3Drafter, target, seqs: list) -> Eagle3Drafter:
    cfg = old.config
    if not cfg.norm_features:
        raise SystemExit("--from: this EAGLE-3 drafter already has no feature norms")
    ht = cfg.target_hidden_size
    rms = torch.zeros(len(cfg.target_layer_ids))
    for seq in seqs:
        hs = target(seq[None], output_hidden_states=True).hidden_states
        x = old.context_features(hs)[0, 1:] * old.feature_scale     # position 0 left out
        rms += torch.stack([p.pow(2).mean(-1).sqrt().mean() for p in x.split(ht, dim=-1)])
    rms /= len(seqs)
    print(f"feature RMS {[round(float(r), 3) for r in rms]}")
    weights = torch.cat([n.weight.float() / r for n, r in zip(old.feature_norms, rms)])
    new = Eagle3Drafter(dataclasses.replace(cfg, norm_features=False, feed_normed_output=False))
    state = {k: v for k, v in old.state_dict().items() if not k.startswith("feature_norms.")}
    state["feature_scale"] = old.feature_scale * weights
    new.load_state_dict(state)
    return new


def dflash(old: DFlashDrafter, target, seqs: list) -> DFlashDrafter:
    cfg = old.config
    if cfg.qk_norm:
        raise SystemExit("--from: this DFlash drafter already has q/k norms")
    d, b = cfg.head_dim, cfg.block_size
    sums = {}

    def hook(name):
        def record(module, inputs, out):
            rms = out.detach().view(-1, out.shape[-1] // d, d).pow(2).mean(-1).sqrt().mean()
            total, n = sums.get(name, (0.0, 0))
            sums[name] = (total + float(rms), n + 1)
        return record

    handles = [getattr(layer.self_attn, f"{w}_proj").register_forward_hook(hook((i, w)))
               for i, layer in enumerate(old.layers) for w in "qk"]
    for seq in seqs:
        hs = target(seq[None], output_hidden_states=True).hidden_states
        anchors = torch.arange(8, seq.shape[0], 64)
        block = torch.full((len(anchors), b), cfg.mask_token_id, dtype=torch.long)
        block[:, 0] = seq[anchors]
        old.block_logits(target, old.context_features(hs)[0], block, anchors)
    for h in handles:
        h.remove()
    new = DFlashDrafter(dataclasses.replace(cfg, qk_norm=True, draft_vocab_size=None))
    state = {k: v for k, v in old.state_dict().items() if k != "d2t"}
    for (i, w), (total, n) in sums.items():
        state[f"layers.{i}.self_attn.{w}_norm.weight"] = torch.full((d,), total / n)
    print({f"layer {i} {w}": round(t / n, 3) for (i, w), (t, n) in sums.items()})
    new.load_state_dict(state)
    return new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", choices=["eagle3", "dflash"], required=True)
    p.add_argument("--from", dest="source", required=True, help="checkpoint folder")
    p.add_argument("--out", required=True, help="folder written (config.json, model.safetensors)")
    p.add_argument("--corpus", default="corpus/train", help="corpus shards (training text)")
    p.add_argument("--texts", type=int, default=32, help="sequences measured")
    args = p.parse_args()

    target, _, _ = load_target()
    cls, convert = {"eagle3": (Eagle3Drafter, eagle3), "dflash": (DFlashDrafter, dflash)}[
        args.drafter]
    old = cls.load(args.source, target=target).float()
    with torch.no_grad():
        new = convert(old, target, corpus_sequences(args.corpus, args.texts))
    new.to(torch.bfloat16).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
