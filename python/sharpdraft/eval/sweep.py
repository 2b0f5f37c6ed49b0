"""Acceptance under many scalings on the same held-out positions (the paper's Table 3
at small scale): a teacher-forced acceptance proxy bucketed by context length, with 95% bootstrap
intervals, each scaling paired against the frozen drafter on the same anchors.

At an anchor a (the last committed token sits at position a of a held-out text) the drafter's
greedy drafts of that step are computed teacher-forced, all anchors of a sequence in one
parallel forward (the drafter's training forward); the proxy is 1 + the number of leading
drafts equal to the target's top-1 token along the text (spec §7), `anchor_leads`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from ..attention import SharpConfig
from ..training import recipe_of
from .mass import scaling_suite
from .report import figure, save_figure, write_report


def anchor_leads(drafter, target, seq: dict, anchors: torch.Tensor) -> torch.Tensor:
    """(A,) int64: at each anchor, how many of the drafter's greedy drafts, in order, equal the
    target's top-1 along the text (teacher forced; `seq` a `training.cache.FeatureSet` item of
    raw features with its "layer_ids"; a row outside the sequence or not trained ends the run).
    The drafting is its kind's training recipe's (`Recipe.anchor_leads`).

    Raises:
        TypeError: the drafter's kind has no teacher-forced drafting (or is not registered).
    """
    try:
        leads = recipe_of(drafter).anchor_leads
    except ValueError:
        leads = None
    if leads is None:
        raise TypeError(f"anchor_leads: no teacher-forced drafting for {type(drafter).__name__}")
    return leads(drafter, target, seq, anchors)


def bootstrap_ci(x: torch.Tensor, reps: int = 2000, seed: int = 0) -> tuple:
    """(mean, low, high): the mean of x and its 95% percentile bootstrap interval."""
    x = x.double()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(x), (reps, len(x)), generator=g)
    means = x[idx].mean(1).sort().values
    return float(x.mean()), float(means[int(0.025 * reps)]), float(means[int(0.975 * reps) - 1])


def sample_anchors(T: int, edges: Sequence[int], per_bucket: int, margin: int,
                   gen: torch.Generator) -> Dict[int, torch.Tensor]:
    """{bucket index: sorted anchors}: up to per_bucket distinct anchors in [edges[i],
    edges[i + 1]) that leave `margin` positions after them inside the sequence."""
    out = {}
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        hi = min(hi, T - margin)
        if hi - lo < 1:
            continue
        pick = torch.randperm(hi - lo, generator=gen)[:per_bucket] + lo
        out[i] = pick.sort().values
    return out


def scalings(n_ref: int, topk: int = 32,
             calibrated: Optional[list] = None) -> Dict[str, SharpConfig]:
    """The sweep: the mass analysis's suite (frozen, constant beta, fixed slopes, exact_topk,
    the calibrated per-layer slopes when given) plus slope 0.2 at n_ref x {0.5, 2, 4} (x 1 is
    "slope 0.2")."""
    suite = scaling_suite(n_ref, topk, calibrated=calibrated)
    for f in (0.5, 2, 4):
        suite[f"slope 0.2, n_ref x{f:g}"] = SharpConfig(mode="fixed_slope", slope=0.2,
                                                       n_ref=max(1, int(n_ref * f)))
    return suite


@torch.no_grad()
def run(target, drafter, features, layer_ids: List[int], *, drafter_name: str,
        edges: Sequence[int], per_bucket: int, out, seed: int = 0, text: str = "",
        only: Optional[Sequence[str]] = None) -> dict:
    """`sharpdraft analyze sweep`: leads of every scaling (or of those named in `only`; frozen
    is always kept, the pairing baseline) at the same anchors of every sequence of `features`,
    bucketed by `edges`; writes sweep.json, sweep.md and sweep.png to `out`. Each row keeps its
    anchors ([sequence, position] pairs) and their leads, so that two sweeps of the same
    drafter kind on the same text and seed pair up across checkpoints (`compare`). A drafter with
    several SharpDraft variants (`sharp_variants`, LongSpark's scopes) runs every scaling in
    each, named "<variant>: <scaling>".

    Raises:
        ValueError: `only` names a scaling the sweep does not have (the message lists them).
    """
    n_ref = drafter.sharp.n_ref
    base = scalings(n_ref, calibrated=getattr(drafter.config, "sharp_slopes", None))
    if only:
        unknown = [n for n in only if n not in base]
        if unknown:
            raise ValueError(f"--scalings: unknown {unknown}; known: {list(base)}")
        base = {n: sc for n, sc in base.items() if n == "frozen" or n in only}
    # every place SharpDraft can act on this drafter (drafter.sharp_variants(); one for most):
    # "<variant>: <scaling>", frozen once (the variants differ only where beta applies)
    variants = drafter.sharp_variants()
    suite = {"frozen": (drafter, base["frozen"])}
    for suffix, d in variants.items():
        for n, sc in base.items():
            if n != "frozen":
                suite[f"{suffix}: {n}" if len(variants) > 1 else n] = (d, sc)
    gen = torch.Generator().manual_seed(seed)
    margin = getattr(drafter, "max_drafts", 8) + 2
    leads: Dict[str, Dict[int, list]] = {name: {} for name in suite}
    jobs = [(s, sample_anchors(int(features.lengths[s]), edges, per_bucket, margin, gen))
            for s in range(len(features))]
    where: Dict[int, list] = {}        # bucket -> [[sequence, anchor], ...] in the leads' order
    for s, by_bucket in jobs:
        for i, a in by_bucket.items():
            where.setdefault(i, []).extend([s, int(p)] for p in a)
    bar = tqdm(total=len(jobs) * len(suite), desc="analyze sweep", unit="run")
    for s, by_bucket in jobs:
        seq = dict(features[s], layer_ids=layer_ids)
        anchors = torch.cat(list(by_bucket.values()))
        bucket = torch.cat([torch.full((len(a),), i) for i, a in by_bucket.items()])
        for name, (d, sc) in suite.items():
            d.sharp = sc
            got = anchor_leads(d, target, seq, anchors)
            for i in by_bucket:
                leads[name].setdefault(i, []).append(got[bucket == i])
            bar.update(1)
    bar.close()
    for d in variants.values():
        d.sharp = SharpConfig(mode="none", n_ref=n_ref)
    rows = []
    for name in suite:
        for i, parts in sorted(leads[name].items()):
            lead = torch.cat(parts)
            x = lead.double() + 1.0
            base = torch.cat(leads["frozen"][i]).double() + 1.0
            m, lo, hi = bootstrap_ci(x, seed=seed)
            d, dlo, dhi = bootstrap_ci(x - base, seed=seed)
            rows.append({"scaling": name, "bucket": [edges[i], edges[i + 1]], "anchors": len(x),
                         "tau_proxy": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)],
                         "delta_vs_frozen": round(d, 4),
                         "delta_ci95": [round(dlo, 4), round(dhi, 4)],
                         "anchors_at": where[i], "leads": lead.tolist()})
    meta = {"drafter": drafter_name, "n_ref": n_ref, "edges": list(edges),
            "context_window": getattr(drafter, "context_window", None),
            "per_bucket": per_bucket, "sequences": len(features), "text": text, "seed": seed}
    write_report(out, "sweep", {"settings": meta, "rows": rows}, markdown(rows, meta), indent=1)
    plot(rows, meta, Path(out) / "sweep.png")
    return {"settings": meta, "rows": rows}


def compare(base: dict, others: Dict[str, dict], base_scaling: str = "frozen",
            seed: int = 0) -> List[dict]:
    """Paired differences across checkpoints: every scaling of every sweep report in `others`
    ({name: sweep.json contents}) against `base_scaling` of the `base` report, anchor by
    anchor, per context bucket. Rows: {"scaling": "<name>: <scaling>", "bucket", "anchors",
    "tau_proxy", "ci95", "delta_vs_base", "delta_ci95"} (95% percentile bootstrap of the mean
    paired difference); the base's own scalings come first, named "base: <scaling>", its
    `base_scaling` at the top.

    Raises:
        ValueError: a report lacks per-anchor leads (written before they were kept), the base
            has no `base_scaling`, or two reports' anchors differ in a bucket (another text,
            seed, drafter kind or --per-bucket: the pairing would be meaningless).
    """
    def by_key(rep, what):
        rows = rep["rows"]
        if any("leads" not in r for r in rows):
            raise ValueError(f"{what}: the sweep report has no per-anchor leads; rerun "
                             f"`sharpdraft analyze sweep`")
        return {(r["scaling"], tuple(r["bucket"])): r for r in rows}
    b = by_key(base, "base")
    first = {k: r for k, r in b.items() if k[0] == base_scaling}      # the base's baseline first
    if not first:
        raise ValueError(f"base: no scaling {base_scaling!r}; it has "
                         f"{list(dict.fromkeys(k[0] for k in b))}")
    ref = {bucket: r for (_, bucket), r in first.items()}
    out = []
    entries = [("base", {**first, **b})]
    entries += [(name, by_key(rep, name)) for name, rep in others.items()]
    for name, rows in entries:
        for (scaling, bucket), r in rows.items():
            if bucket not in ref:
                continue
            if r["anchors_at"] != ref[bucket]["anchors_at"]:
                raise ValueError(f"{name}: the anchors of bucket {bucket[0]}-{bucket[1]} differ "
                                 f"from the base's (another text, seed, drafter kind or "
                                 f"--per-bucket)")
            x = torch.tensor(r["leads"], dtype=torch.float64) + 1.0
            y = torch.tensor(ref[bucket]["leads"], dtype=torch.float64) + 1.0
            m, lo, hi = bootstrap_ci(x, seed=seed)
            d, dlo, dhi = bootstrap_ci(x - y, seed=seed)
            out.append({"scaling": f"{name}: {scaling}", "bucket": list(bucket),
                        "anchors": len(x), "tau_proxy": round(m, 4),
                        "ci95": [round(lo, 4), round(hi, 4)], "delta_vs_base": round(d, 4),
                        "delta_ci95": [round(dlo, 4), round(dhi, 4)]})
    return out


def compare_markdown(rows: List[dict], meta: dict) -> str:
    """compare.md: tau [95% interval] of every entry, then its paired difference from the
    base, by context bucket."""
    header = [f"Teacher-forced tau proxy of {meta['drafter']} checkpoints on the same anchors "
              f"({meta['text']}), by context bucket (tokens); base: {meta['base']} "
              f"({meta['base_scaling']}). Each cell: tau [95% bootstrap interval]; below, the "
              f"paired difference from the base on the same anchors.", ""]
    table = bucket_table(rows, "checkpoint: scaling", lambda c: f"{c['tau_proxy']:.3f} "
                         f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
    delta = bucket_table(rows, "minus base", lambda c: f"{c['delta_vs_base']:+.3f} "
                         f"[{c['delta_ci95'][0]:+.2f}, {c['delta_ci95'][1]:+.2f}]",
                         skip=(rows[0]["scaling"],) if rows else ())
    return "\n".join(header + table + [""] + delta) + "\n"


def markdown(rows: List[dict], meta: dict) -> str:
    header = [f"Teacher-forced acceptance proxy tau (1 + leading drafts equal to the target's "
              f"top-1) of the {meta['drafter']} drafter on {meta['text']}, by context bucket "
              f"(tokens), {meta['per_bucket']} anchors per bucket and sequence, "
              f"n_ref {meta['n_ref']}"
              + (f", context window {meta['context_window']}" if meta.get("context_window")
                 else "") + ". Each cell: tau [95% bootstrap interval]; below, the paired "
              "difference from frozen on the same anchors.", ""]
    table = bucket_table(rows, "scaling", lambda c: f"{c['tau_proxy']:.3f} "
                         f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
    return "\n".join(header + table + delta_table(rows)) + "\n"


def bucket_table(rows: List[dict], title: str, cell: Callable[[dict], str],
                 skip: Sequence[str] = ()) -> List[str]:
    """Markdown lines of a table with one row per scaling (in first-seen order, less ``skip``)
    and one column per context bucket; ``cell(row)`` renders a filled cell, a missing
    (scaling, bucket) pair stays empty. ``title`` heads the first column."""
    buckets = sorted({tuple(r["bucket"]) for r in rows})
    get = {(r["scaling"], tuple(r["bucket"])): r for r in rows}
    names = [n for n in dict.fromkeys(r["scaling"] for r in rows) if n not in skip]
    lines = [f"| {title} | " + " | ".join(f"{a}-{b}" for a, b in buckets) + " |",
             "|---|" + "---:|" * len(buckets)]
    for name in names:
        cells = [get.get((name, b)) for b in buckets]
        lines.append(f"| {name} | " + " | ".join("" if c is None else cell(c) for c in cells)
                     + " |")
    return lines


def delta_table(rows: List[dict]) -> List[str]:
    """Markdown lines of the difference from frozen (delta_vs_frozen [delta_ci95]) of every
    scaling but frozen, by bucket."""
    return [""] + bucket_table(
        rows, "scaling - frozen", lambda c: f"{c['delta_vs_frozen']:+.3f} "
        f"[{c['delta_ci95'][0]:+.2f}, {c['delta_ci95'][1]:+.2f}]", skip=("frozen",))


def plot(rows: List[dict], meta: dict, path, *, xlabel: str = "context at the anchor (tokens)",
         ylabel: str = "tau proxy (teacher forced)", what: str = "acceptance proxy by context",
         log_x: bool = True) -> None:
    """One line per scaling with its 95% intervals, at each bucket's geometric (log_x) or
    arithmetic centre."""
    fig, ax = figure(figsize=(7, 4.5))
    names = list(dict.fromkeys(r["scaling"] for r in rows))
    if len(names) > 10:               # more lines than the default cycle has colours
        import matplotlib
        tab20 = matplotlib.colormaps["tab20"]
        ax.set_prop_cycle(color=[tab20(k % 20) for k in range(len(names))])
    for k, name in enumerate(names):
        rs = sorted((r for r in rows if r["scaling"] == name), key=lambda r: r["bucket"][0])
        centre = [math.sqrt(r["bucket"][0] * r["bucket"][1]) if log_x
                  else (r["bucket"][0] + r["bucket"][1]) / 2 for r in rs]
        x = [c * (1 + 0.02 * (k - len(names) / 2)) for c in centre]
        y = [r["tau_proxy"] for r in rs]
        err = [[r["tau_proxy"] - r["ci95"][0] for r in rs], [r["ci95"][1] - r["tau_proxy"]
                                                             for r in rs]]
        ax.errorbar(x, y, yerr=err, fmt="o-" if name == "frozen" else ".-", capsize=2, lw=1,
                    label=name)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{meta['drafter']}: {what}, 95% bootstrap intervals")
    ax.legend(fontsize=6, ncol=2)
    save_figure(fig, path)
