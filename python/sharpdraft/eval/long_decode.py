"""Acceptance by output length in real decoding (the paper's Table 3 groups by final output
length).

Prompts that make the target write long answers. None of them was trained on: Genesis is held
out, and the other tasks are written here. They are:

- continuing a passage of Genesis;
- a diary kept over many days;
- a multi-part question set;
- a step-by-step derivation.

Each is decoded greedily, up to `max_new_tokens`, with the drafter under each scaling. Greedy
speculative decoding is lossless, so every scaling decodes the same text and only the drafts
differ. Each verification step's committed length is grouped by how many tokens had been
generated before it, in buckets of `bucket` tokens. The 95% intervals come from a bootstrap over
the steps of a bucket; the difference from frozen comes from resampling both sides.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from ..data import sources as data
from ..attention import SharpConfig
from ..inference.engine import speculative_generate
from .report import write_report
from .sweep import bootstrap_ci, bucket_table, delta_table, plot, scalings

TASKS = {
    "diary": "Write the diary of a shepherd in the hills for thirty days, one entry per day, "
             "each entry at least five sentences long, naming the day.",
    "questions": "Answer each of the following ten questions in a detailed paragraph: 1. Why "
                 "is the sky blue? 2. How do vaccines work? 3. What causes the seasons? 4. How "
                 "does a bicycle stay upright? 5. Why do we dream? 6. How is bread made? 7. "
                 "What is inflation? 8. How do birds migrate? 9. Why does ice float? 10. How "
                 "does a computer store data?",
    "derivation": "Derive, step by step and explaining every step, the formula for the sum of "
                  "the first n squares, then check it for n = 1 to 10, then derive the sum of "
                  "the first n cubes the same way.",
}
DEFAULT_SCALINGS = ("slope 0.2", "const e^0.2")


def long_output_prompts(tokenizer, genesis_tokens: int = 1024) -> List[dict]:
    """[{name, kind, ids}]: "genesis-continue" (the first `genesis_tokens` tokens of Genesis and
    a request to continue it) and the TASKS, in the chat template."""
    words = tokenizer(data.kjv_text("Ge"), add_special_tokens=False).input_ids
    texts = {"genesis-continue": tokenizer.decode(words[:genesis_tokens])
             + "\n\nContinue this text from where it stops, in the same style, for as long "
               "as you can.", **TASKS}
    out = []
    for name, text in texts.items():
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_dict=False)
        out.append({"name": name, "kind": "long", "ids": torch.tensor([list(ids)])})
    return out


def bootstrap_diff(x: torch.Tensor, y: torch.Tensor, reps: int = 2000, seed: int = 0) -> tuple:
    """(mean(x) - mean(y), low, high): the difference of two independent samples' means and
    its 95% percentile bootstrap interval."""
    g = torch.Generator().manual_seed(seed)
    mx = x.double()[torch.randint(len(x), (reps, len(x)), generator=g)].mean(1)
    my = y.double()[torch.randint(len(y), (reps, len(y)), generator=g)].mean(1)
    d = (mx - my).sort().values
    return (float(x.double().mean() - y.double().mean()), float(d[int(0.025 * reps)]),
            float(d[int(0.975 * reps) - 1]))


def run(target, tokenizer, drafter, prompts: List[dict], *, drafter_name: str,
        max_new_tokens: int, bucket: int, out, only: Optional[Sequence[str]] = None,
        seed: int = 0) -> dict:
    """Decode every prompt under frozen and each scaling named in `only` (default
    DEFAULT_SCALINGS); write decode.json, decode.md and decode.png to `out`.

    Raises:
        ValueError: `only` names a scaling the sweep does not have.
    """
    n_ref = drafter.sharp.n_ref
    suite = scalings(n_ref)
    names = ["frozen"] + [n for n in (only or DEFAULT_SCALINGS) if n != "frozen"]
    unknown = [n for n in names if n not in suite]
    if unknown:
        raise ValueError(f"--scalings: unknown {unknown}; known: {list(suite)}")
    steps: Dict[str, Dict[int, list]] = {n: {} for n in names}
    lengths, identical = {}, True
    bar = tqdm(total=len(prompts) * len(names), desc="analyze sweep --decode", unit="run")
    for p in prompts:
        P = p["ids"].shape[1]
        ref = None
        for name in names:
            drafter.sharp = suite[name]
            res = speculative_generate(target, drafter, p["ids"], max_new_tokens,
                                       eos_token_id=tokenizer.eos_token_id)
            ref = res.tokens if ref is None else ref
            identical &= res.tokens == ref
            lengths[p["name"]] = len(res.tokens)
            for a, c in zip(res.accept_lengths, res.context_lengths):
                steps[name].setdefault((c - P) // bucket, []).append(a)
            bar.update(1)
    bar.close()
    drafter.sharp = SharpConfig(mode="none", n_ref=n_ref)
    rows = []
    for name in names:
        for i, acc in sorted(steps[name].items()):
            x = torch.tensor(acc, dtype=torch.float64)
            base = torch.tensor(steps["frozen"][i], dtype=torch.float64)
            m, lo, hi = bootstrap_ci(x, seed=seed)
            d, dlo, dhi = bootstrap_diff(x, base, seed=seed)
            rows.append({"scaling": name, "bucket": [i * bucket, (i + 1) * bucket],
                         "steps": len(x), "tau": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)],
                         "delta_vs_frozen": round(d, 4), "delta_ci95": [round(dlo, 4), round(dhi, 4)]})
    meta = {"drafter": drafter_name, "n_ref": n_ref, "max_new_tokens": max_new_tokens,
            "bucket": bucket, "prompts": [p["name"] for p in prompts],
            "output_tokens": lengths, "same_text_under_every_scaling": identical}
    write_report(out, "decode", {"settings": meta, "rows": rows}, markdown(rows, meta), indent=1)
    plot([dict(r, tau_proxy=r["tau"]) for r in rows], meta, Path(out) / "decode.png",
         xlabel="tokens generated before the step", ylabel="tau (real greedy decoding)",
         what="acceptance by output length", log_x=False)
    return {"settings": meta, "rows": rows}


def markdown(rows: List[dict], meta: dict) -> str:
    lens = ", ".join(f"{k} {v}" for k, v in meta["output_tokens"].items())
    header = [f"Real greedy decoding with the {meta['drafter']} drafter: tau by output length "
              f"(tokens generated before each verification step, buckets of {meta['bucket']}), "
              f"up to {meta['max_new_tokens']} new tokens, n_ref {meta['n_ref']}; prompts "
              f"(output tokens): {lens}. Same text under every scaling: "
              f"{meta['same_text_under_every_scaling']}. Each cell: tau [95% bootstrap over the "
              "steps] (steps); below, the difference from frozen.", ""]
    table = bucket_table(rows, "scaling", lambda c: f"{c['tau']:.3f} "
                         f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}] ({c['steps']})")
    return "\n".join(header + table + delta_table(rows)) + "\n"
