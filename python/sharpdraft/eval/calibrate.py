"""Per-layer (per-head) slope calibration (spec §1 "Calibration", §7; the paper's Fig. 7).

A layer's top-k mass M_ref at its reference cardinality n_ref inverts the two-level model:

    Delta = ln((n_ref - k) / k) - ln(1 / M_ref - 1),   slope = 1 / Delta

`calibrate` measures M_ref of every drafter layer (or head) on held-out reference prompts whose
context is n_ref tokens (the frozen drafter's own rows while it decodes, `mass.AttentionProbe`),
and writes the slopes into the checkpoint's config.json (`sharp_slopes`), where `--sharp` finds
them unless `--slope` is given.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import torch

from ..attention import SharpConfig, observe
from .bench import build_prompts
from ..inference.engine import speculative_generate
from .mass import AttentionProbe, attention_modules, summarise
from .report import figure, write_json, write_report

MAX_SLOPE = 1.0          # Delta < 1: a nearly uniform layer; its slope is capped here


def contrast_from_mass(m_ref: float, n_ref: int, k: int) -> float:
    """Delta of the two-level model whose top-k mass at n_ref keys is m_ref (spec §1); -inf
    or below 0 when m_ref is at or under the uniform k / n_ref.

    Raises:
        ValueError: n_ref <= k or m_ref outside (0, 1].
    """
    if n_ref <= k:
        raise ValueError(f"n_ref must exceed k, got n_ref={n_ref}, k={k}")
    if not 0.0 < m_ref <= 1.0:
        raise ValueError(f"top-k mass must lie in (0, 1], got {m_ref}")
    if m_ref >= 1.0:
        return math.inf
    return math.log((n_ref - k) / k) - math.log(1.0 / m_ref - 1.0)


def slope_from_mass(m_ref: float, n_ref: int, k: int) -> float:
    """1 / Delta, clamped to [0, MAX_SLOPE] (a layer at or below uniform mass gets MAX_SLOPE;
    a one-hot layer, Delta = inf, gets 0: nothing to sharpen)."""
    delta = contrast_from_mass(m_ref, n_ref, k)
    if delta <= 1.0 / MAX_SLOPE:
        return MAX_SLOPE
    return 1.0 / delta


@torch.no_grad()
def measure(target, tokenizer, drafter, *, n_ref: int, steps: int = 16, topk: int = 32,
            rows: int = 32, seed: int = 0) -> dict:
    """Top-k mass of every drafter layer (per head) at context n_ref: the frozen drafter decodes
    `steps` tokens after the bench's held-out KJV prompt (Genesis + its task) of about n_ref
    tokens. Returns {layer: {"mass": float, "mass_per_head": [...], "mean_n": float,
    "rows": int}}."""
    drafter.sharp = SharpConfig(mode="none", n_ref=n_ref)
    probe = AttentionProbe(attention_modules(drafter, torch.nn.Module()),
                           {"frozen": SharpConfig(mode="none", n_ref=n_ref)}, topk=topk,
                           rows=rows, seed=seed)
    task = build_prompts(tokenizer, [1], 0)[0]["ids"].shape[1] - 1     # template + task tokens
    ids = build_prompts(tokenizer, [max(1, n_ref - task)], 0)[0]["ids"]
    with observe(probe):
        speculative_generate(target, drafter, ids, steps)
    return {r["layer"]: {"mass": r["topk_mass"], "mass_per_head": r["topk_mass_per_head"],
                         "mean_n": r["mean_n"], "rows": r["rows"]} for r in summarise(probe)}


def slopes(measured: dict, n_ref: int, k: int, per_head: bool = False) -> List:
    """sharp_slopes of a drafter from `measure`'s output: one float per layer (layer-mean
    mass) or, per_head, one list of per-head floats per layer."""
    result = []
    for layer in sorted(measured):
        m = measured[layer]
        if per_head:
            result.append([round(slope_from_mass(x, n_ref, k), 4) for x in m["mass_per_head"]])
        else:
            result.append(round(slope_from_mass(m["mass"], n_ref, k), 4))
    return result


def write_slopes(folder, values: Optional[list]) -> None:
    """Set `sharp_slopes` in the checkpoint's config.json (temporary file, then rename)."""
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["sharp_slopes"] = values
    write_json(path, cfg)


def run(target, tokenizer, drafter, *, checkpoint: Optional[Path], out, steps: int = 16,
        topk: int = 32, rows: int = 32, per_head: bool = False, seed: int = 0,
        drafter_name: str = "drafter") -> dict:
    """`sharpdraft analyze calibrate`: measure, invert, write the slopes into `checkpoint`'s
    config (when given), and write calibrate.json / calibrate.md / calibrate.png to `out`."""
    n_ref = drafter.sharp.n_ref
    measured = measure(target, tokenizer, drafter, n_ref=n_ref, steps=steps, topk=topk,
                       rows=rows, seed=seed)
    values = slopes(measured, n_ref, topk, per_head)
    if checkpoint is not None:
        write_slopes(checkpoint, values)
    report = {"drafter": drafter_name, "checkpoint": str(checkpoint) if checkpoint else None,
              "n_ref": n_ref, "topk": topk, "steps": steps, "per_head": per_head,
              "default_slope": 0.2, "measured": measured, "sharp_slopes": values,
              "contrast": {layer: contrast_from_mass(m["mass"], n_ref, topk)
                           for layer, m in measured.items()}}
    lines = [f"Calibrated slopes of the {drafter_name} drafter: top-{topk} mass at n_ref = "
             f"{n_ref} (held-out KJV Genesis, {steps} decoding steps), Delta = "
             f"ln((n_ref - k) / k) - ln(1 / M - 1), slope = 1 / Delta (capped at {MAX_SLOPE}); "
             f"the default slope is 0.2 (Delta = 5).", "",
             "| layer | mean n | top-k mass | Delta | slope |", "|---:|---:|---:|---:|---:|"]
    for layer in sorted(measured):
        m, d = measured[layer], report["contrast"][layer]
        s = slope_from_mass(m["mass"], n_ref, topk)
        lines.append(f"| {layer} | {m['mean_n']:.0f} | {m['mass']:.4f} | {d:.2f} | {s:.3f} |")
    fig, ax = figure(figsize=(5, 3.5))
    layers = sorted(measured)
    ax.bar([str(x) for x in layers], [slope_from_mass(measured[x]["mass"], n_ref, topk)
                                       for x in layers], label="calibrated")
    ax.axhline(0.2, color="k", ls="--", label="default 0.2")
    ax.set_xlabel("drafter layer")
    ax.set_ylabel("slope lambda = 1 / Delta")
    ax.set_title(f"{drafter_name}: calibrated slopes (n_ref {n_ref})")
    ax.legend()
    write_report(out, "calibrate", report, lines, indent=1, default=str, figure=fig)
    return report
